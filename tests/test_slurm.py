"""Submitted to a real Slurm: the two-node cluster of ``scripts/slurm_local.sh`` on this host.

prep-data's job array and merge are submitted with ``sbatch`` and followed to the end; the bytes
must equal the local executor's after an ``scancel`` mid-way and ``--resume``. A task that fails is named with its log, and what cannot be submitted (no sbatch, a
partition that does not exist) fails before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_prep import testing as T
from data_prep.prep import output_prefix_for

TIMEOUT = 600


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tokenizer, two JSONL files (one with a bad line, skipped) and the local executor's
    output for them: what every Slurm run must reproduce byte for byte."""
    root = tmp_path_factory.mktemp("slurm-corpus")
    tok = T.train_hf_bpe(T.synthetic_texts(80, seed=3), root / "tok", 300)
    texts = T.synthetic_texts(160, seed=12, mean_chars=300)
    a = T.write_jsonl(root / "a.jsonl", [{"text": t} for t in texts], raw_lines={40: b"["})
    b = T.write_jsonl(root / "b.jsonl", [{"text": t} for t in texts[:40]])
    local = root / "local"
    done = _prep([a, b], tok, local, ["--executor", "local"], os.environ)
    assert done.returncode == 0, done.stderr
    assert _bytes(local)[2] is not None  # the provenance sidecar, compared with the rest
    return {"tok": tok, "inputs": [a, b], "local": local}


def _prep(inputs, tok, out, extra, env, **kw) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "porting.cli", "prep-data", "--input", *map(str, inputs),
        "--output-prefix", str(out), "--tokenizer", str(tok), "--append-eod",
        "--on-error", "skip", "--no-progress", *extra,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=TIMEOUT, **kw)


_bytes = T.dataset_bytes  # .bin, .idx and the provenance sidecar


def _slurm(env, *argv) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _block(env, nodes: str) -> str:
    """A job holding ``nodes`` (their one CPU each) until cancelled: what comes after queues."""
    return _slurm(env, "sbatch", "--parsable", "-w", nodes, "-N", str(len(nodes.split(","))),
                  "--wrap", "sleep 300", "-o", "/dev/null")  # fmt: skip


def _wait_for(what, predicate, timeout=120.0, every=0.2):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def test_prep_data_cancelled_mid_way_resumes_to_the_local_bytes(slurm_cluster, corpus, tmp_path):
    """scancel on the unit array while the command follows it: the command says so and keeps the
    finished units; the same command with --resume submits only the others, follows them over
    both nodes and their merge to the end, and the dataset is the local executor's, byte for byte,
    with its report's skipped records; it prints our lines only."""
    out = tmp_path / "out"
    staging = Path(f"{out}.prep-data.units")
    blocker = _block(slurm_cluster, "node1")  # the units run one at a time on node2
    try:
        argv = ["--executor", "slurm", "--unit-mb", "0.006"]
        follower = subprocess.Popen(
            [sys.executable, "-m", "porting.cli", "prep-data", "--input",
             *map(str, corpus["inputs"]), "--output-prefix", str(out), "--tokenizer",
             str(corpus["tok"]), "--append-eod", "--on-error", "skip", "--no-progress", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm_cluster,
        )  # fmt: skip
        try:
            _wait_for("a first unit", lambda: any(staging.glob("u*.json")))
            sub = json.loads(Path(f"{out}.prep-data.slurm/submitted.json").read_text())
            _slurm(slurm_cluster, "scancel", sub["units_job"])
            stdout, stderr = follower.communicate(timeout=TIMEOUT)
        finally:
            follower.kill()
        assert follower.returncode == 2, stderr
        assert f"the unit array (job {sub['units_job']}) was cancelled after" in stderr, stderr
        assert "rerun the same command with --resume" in stderr
        finished = len(list(staging.glob("u*.json")))
        assert 1 <= finished < sub["submitted_units"]
        assert not Path(f"{output_prefix_for(out, 'text')}.bin").exists()
    finally:
        _slurm(slurm_cluster, "scancel", blocker)

    done = _prep(corpus["inputs"], corpus["tok"], out, [*argv, "--resume"], slurm_cluster)
    assert done.returncode == 0, done.stderr + done.stdout
    sub = json.loads(Path(f"{out}.prep-data.slurm/submitted.json").read_text())
    report = json.loads(Path(f"{out}.prep-report.json").read_text())
    assert sub["submitted_units"] == len(report["units"]) - finished
    assert _bytes(out) == _bytes(corpus["local"])
    from porting.testing import foreign_lines

    assert foreign_lines(done.stdout + done.stderr) == []
    assert report["executor"] == "slurm" and len(report["units"]) >= 4
    local = json.loads(Path(f"{corpus['local']}.prep-report.json").read_text())
    assert report["skipped_records"] == local["skipped_records"]
    assert [r["line"] for r in report["skipped_records"]] == [41]
    # the dataset's summary, as the local executor prints it; nothing left staged
    assert "_text_document.bin/.idx/.prov  text:" in done.stdout, done.stdout
    assert not staging.exists()
    states = _slurm(slurm_cluster, "scontrol", "-o", "show", "job", sub["units_job"])
    nodes = set(re.findall(r" NodeList=(\S+)", states))
    assert nodes == {"node1", "node2"}, nodes  # the rest of the array ran on both nodes


def test_a_failed_task_is_named_with_its_log_and_status_tells_where_a_job_stands(
    slurm_cluster, corpus, tmp_path
):
    """--no-wait hands over once submitted; `status` says the job is queued (exit 3); an input
    changed before its tasks ran fails them, and `status --wait` names the first with its log."""
    inputs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for src, dst in zip(corpus["inputs"], inputs, strict=True):
        dst.write_bytes(Path(src).read_bytes())
    out = tmp_path / "out"
    emit = tmp_path / "jobs"
    blocker = _block(slurm_cluster, "node1,node2")
    try:
        done = _prep(inputs, corpus["tok"], out,
                     ["--executor", "slurm", "--emit", str(emit), "--no-wait"],
                     slurm_cluster)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "submitted: unit array" in done.stdout
        assert f"porting prep-data status --job {emit}/job.json" in done.stdout
        submitted = json.loads((emit / "submitted.json").read_text())
        status = subprocess.run(
            [sys.executable, "-m", "porting.cli", "prep-data", "status", "--job",
             str(emit / "job.json")],
            capture_output=True, text=True, env=slurm_cluster, timeout=120,
        )  # fmt: skip
        assert status.returncode == 3, status.stderr
        assert "0/2 units done; units: " in status.stdout and "pending" in status.stdout
        # a second run on the same output while the job is queued: refused, the job untouched
        again = _prep(inputs, corpus["tok"], out,
                      ["--executor", "slurm", "--emit", str(emit), "--no-wait"],
                      slurm_cluster)  # fmt: skip
        assert again.returncode == 2, again.stderr
        assert "submitted from here is still pending" in again.stderr, again.stderr
        assert json.loads((emit / "submitted.json").read_text()) == submitted
        with open(inputs[0], "ab") as fh:  # changed since planning
            fh.write(b'{"text": "one more line"}\n')
    finally:
        _slurm(slurm_cluster, "scancel", blocker)
    followed = subprocess.run(
        [sys.executable, "-m", "porting.cli", "prep-data", "status", "--job",
         str(emit / "job.json"), "--wait"],
        capture_output=True, text=True, env=slurm_cluster, timeout=TIMEOUT,
    )  # fmt: skip
    assert followed.returncode == 2, followed.stderr
    err = followed.stderr
    assert "unit 0 (job " in err and "ended FAILED on node" in err, err
    assert f"its log {emit}/logs/unit-0.out ends:" in err
    assert "a.jsonl" in err and "changed" in err, err  # the task's own error, from its log
    assert not Path(f"{output_prefix_for(out, 'text')}.bin").exists()
    sub = json.loads((emit / "submitted.json").read_text())
    merge = _slurm(slurm_cluster, "scontrol", "-o", "show", "job", sub["merge_job"])
    assert "JobState=CANCELLED" in merge, merge  # the merge does not run after a failed unit


def test_what_cannot_be_submitted_fails_before_anything_is_written(slurm_cluster, corpus, tmp_path):
    out = tmp_path / "out"
    no_slurm = {**slurm_cluster, "PATH": os.path.dirname(sys.executable)}  # /bin is /usr/bin
    done = _prep(corpus["inputs"], corpus["tok"], out, ["--executor", "slurm"], no_slurm)
    assert done.returncode == 2, done.stderr
    assert "sbatch not found on PATH" in done.stderr and "--no-submit" in done.stderr
    assert list(tmp_path.iterdir()) == []

    done = _prep(corpus["inputs"], corpus["tok"], out,
                 ["--executor", "slurm", "--partition", "nowhere"], slurm_cluster)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "sbatch refused the unit array:" in done.stderr and "nowhere" in done.stderr, done.stderr
    assert not Path(f"{out}.prep-data.units").exists()
    assert not Path(f"{output_prefix_for(out, 'text')}.bin").exists()


def test_conversions_in_a_slurm_step_print_only_our_lines(slurm_cluster, tiny_llama, tmp_path):
    """Inside a job step every SLURM_* variable is set (Lightning's cue for its Slurm environment):
    import and verify still print only our lines."""
    from porting.testing import foreign_lines

    for argv in (
        ["import", str(tiny_llama), "--out", str(tmp_path / "ckpt")],
        ["verify", str(tiny_llama), str(tmp_path / "ckpt")],
    ):
        done = subprocess.run(
            ["srun", "-N1", sys.executable, "-m", "porting.cli", *argv],
            capture_output=True, text=True, env=slurm_cluster, timeout=TIMEOUT, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert foreign_lines(done.stdout + done.stderr) == [], argv
        assert "parity PASS" in done.stdout + done.stderr


def _train_argv(tiny_nemo, train_corpus) -> list[str]:
    return [
        sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(tiny_nemo),
        "--data", str(train_corpus), "--seq-length", "32", "--micro-batch", "2",
        "--global-batch", "4", "--lr", "1e-2", "--steps", "8", "--warmup", "2",
        "--save-every", "4",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(slurm_cluster, tiny_nemo, train_corpus, tmp_path_factory) -> dict[int, float]:
    """The losses of the same training in one process here: what two nodes must reproduce."""
    from porting.testing import train_losses

    out = tmp_path_factory.mktemp("one") / "run"
    ref = subprocess.run(
        [*_train_argv(tiny_nemo, train_corpus), "--out", str(out)], capture_output=True,
        text=True, timeout=TIMEOUT, env=slurm_cluster,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    return train_losses(out)


def _two_nodes(tiny_nemo, train_corpus, out: Path) -> list[str]:
    return [*_train_argv(tiny_nemo, train_corpus), "--out", str(out), "--nodes", "2",
            "--gpus-per-node", "1", "--executor", "slurm"]  # fmt: skip


def _at_first_checkpoint(
    argv: list[str], out: Path, env
) -> tuple[subprocess.Popen, str, list[int]]:
    """Start the two-node training ``argv`` (the command follows its job); once the first
    checkpoint (step 4) is complete and the losses of its steps are written, freeze the job's
    processes where they are, as a node that fails at that instant would: the following
    process, the Slurm job id and the frozen pids.

    Unfrozen, the job's last four steps and its last save could finish before Slurm acted on a
    node set down (run 59 on a loaded host): the resume would then have no step left to prove.
    Frozen at the checkpoint alone, step 4's loss, which the logger writes just after the save,
    was lost with the node (run 60)."""
    from porting.testing import checkpoint_complete, train_losses

    follower = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)  # fmt: skip
    try:
        _wait_for("a complete checkpoint and its steps' losses",
                  lambda: checkpoint_complete(out) and set(range(4)) <= set(train_losses(out)),
                  timeout=TIMEOUT, every=0.02)  # fmt: skip
        frozen = _signal_job(out, follower.pid, signal.SIGSTOP)
        (log,) = (out / "slurm").glob("job-*.out")
    except BaseException:
        follower.kill()
        raise
    return follower, log.stem.removeprefix("job-"), frozen


def _signal_job(out: Path, follower: int, sig: int, pids: list[int] | None = None) -> list[int]:
    """Send ``sig`` to the job's processes (those naming ``out``, not the following command nor
    what it runs), or to those of ``pids`` still alive; the pids signalled."""
    from porting.testing import processes_mentioning

    if pids is None:
        pids = [int(line.split(":", 1)[0]) for line in processes_mentioning(str(out))]
    sent = []
    for pid in pids:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if follower in (pid, parent):
                continue
            os.kill(pid, sig)
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        sent.append(pid)
    return sent


def _assert_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(8)), got
    diffs = {s: abs(got[s] - want[s]) for s in want}
    assert max(diffs.values()) <= 1e-5, diffs


def test_train_on_two_nodes_requeued_then_cancelled_and_resumed_follows_one_process(
    slurm_cluster, tiny_nemo, train_corpus, one_process, tmp_path
):
    """`porting train --executor slurm`: torchrun on both nodes, the rendezvous at the first
    node's NodeAddr. Once a checkpoint is complete a node goes down: Slurm ends the job
    (NODE_FAIL) and requeues it; the command says so and keeps following. Once the requeued job
    runs, scancel: the command says how it ended and what to do; the same command resumes, and
    every step's loss equals one process's (DP=2 over two nodes vs DP=1) within 1e-5. One run for
    both ways a job ends early: each costs a two-node start-up of NeMo on these two cores."""
    from porting.testing import foreign_lines, processes_mentioning, train_losses

    out = tmp_path / "two"
    argv = _two_nodes(tiny_nemo, train_corpus, out)
    follower, job, frozen = _at_first_checkpoint(argv, out, slurm_cluster)
    try:
        _slurm(slurm_cluster, "scontrol", "update", "nodename=node2", "state=down",
               "reason=porting-test")  # fmt: skip
        _wait_for("the requeue", lambda: "Restarts=1" in _slurm(
            slurm_cluster, "scontrol", "-o", "show", "job", job))  # fmt: skip
        # Slurm ended the job before requeueing it; a frozen rank it did not reach (the down
        # node's) runs on to find its peers gone, as it would have unfrozen
        _signal_job(out, follower.pid, signal.SIGCONT, frozen)
        # ReturnToService=2: the node's slurmd registers again and it is back in service
        _wait_for("node2 back", lambda: "down" not in _slurm(
            slurm_cluster, "sinfo", "-h", "-n", "node2", "-o", "%t"))  # fmt: skip
        # a requeued batch job becomes eligible again cred_expire later (20 s, scripts/slurm_local.sh)
        _wait_for("the requeued job to run", lambda: "JobState=RUNNING" in _slurm(
            slurm_cluster, "scontrol", "-o", "show", "job", job), timeout=TIMEOUT)  # fmt: skip
        _slurm(slurm_cluster, "scancel", job)
        stdout, stderr = follower.communicate(timeout=TIMEOUT)
    finally:
        follower.kill()
    assert follower.returncode == 2, stderr[-3000:]
    assert f"Slurm requeued job {job} (restart 1): it resumes" in stdout
    assert f"Slurm job {job} ended CANCELLED" in stderr, stderr[-3000:]
    assert "rerun the same command to resume" in stderr
    assert "step 1/8" in stdout  # the job's log, followed
    assert not processes_mentioning(str(out), grace=10)
    states = _slurm(slurm_cluster, "scontrol", "-o", "show", "job", job)
    assert " NodeList=node[1-2] " in states

    # DP=2's checkpoint, in the default format: the distributed optimizer, DP-reshardable
    layouts = [json.loads(p.read_text()) for p in
               (out / "checkpoints").glob("step=*/context/train_layout.json")]  # fmt: skip
    assert layouts and {(x["distributed_optimizer"], x["optimizer_format"]) for x in layouts} == {
        (True, "dp_reshardable")
    }, layouts
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, env=slurm_cluster)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "done: checkpoints in" in done.stdout
    # resumed, not restarted: the job's first step is one after a checkpoint
    assert "step 1/8 " not in done.stdout and " loss " in done.stdout, done.stdout[-3000:]
    built = json.loads((out / "run.json").read_text())["built"]
    assert built["world_size"] == 2 and built["optimizer"] == ["DistributedOptimizer"]
    assert (built["tp"], built["pp"], built["dp"]) == (1, 1, 2)
    assert built["megatron_timers"] is False
    assert (out / "checkpoints" / "last" / "weights" / "metadata.json").exists()
    # the submitting command and the job's log it prints: our lines only
    foreign = foreign_lines(done.stdout + done.stderr)
    assert foreign == [], "\n".join(foreign)
    _assert_losses(train_losses(out), one_process)


def test_a_plans_emitted_sbatch_runs_on_the_cluster_as_one_process(
    slurm_cluster, tiny_nemo, train_corpus, one_process, tmp_path
):
    """`porting plan --emit` for two one-GPU sites, its train.sbatch submitted as it is (hosts
    file: the two nodes; extra train flags after the script): both ranks run, on both nodes, and
    the losses are one process's (the module's reference run) within 1e-5."""
    from porting.testing import cpu_cluster, train_losses

    cluster = cpu_cluster(tmp_path / "two-sites.yaml", "two-sites", {"a": 1, "b": 1})
    emit, out = tmp_path / "launch", tmp_path / "run"
    planned = subprocess.run(
        [sys.executable, "-m", "porting.cli", "plan", "--model", str(tiny_nemo), "--cluster",
         str(cluster), "--global-batch", "4", "--seq-length", "32", "--emit", str(emit),
         "--data", str(train_corpus), "--out", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT, env=slurm_cluster,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-3000:]
    (emit / "hosts").write_text("node2\nnode1\n")  # site a on node2: ranks follow the file
    # the reference run's schedule; saving or not changes no loss
    extra = ["--steps", "8", "--save-every", "0", "--lr", "1e-2", "--warmup", "2"]
    # submitted from the emitted directory, as its comment says, with this environment's torchrun
    from porting.cpu import free_port

    # a fresh rendezvous port (the script's default 29500 may be taken on a shared test host), and
    # both nodes back in service after the earlier tests (one set a node down)
    env = {**slurm_cluster, "PATH": f"{Path(sys.executable).parent}:{slurm_cluster['PATH']}",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    _wait_for("two idle nodes", lambda: _slurm(
        slurm_cluster, "sinfo", "-h", "-o", "%t %D") == "idle 2", timeout=300)  # fmt: skip
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--wait", "--time", "5", "train.sbatch", *extra],
        capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=emit,
    )  # fmt: skip
    job = submitted.stdout.strip()
    log = emit / f"slurm-{job}.out"
    assert submitted.returncode == 0, log.read_text()[-3000:]
    states = _slurm(slurm_cluster, "scontrol", "-o", "show", "job", job)
    assert "JobState=COMPLETED" in states, log.read_text()[-3000:]
    assert " NodeList=node[1-2] " in states

    got = train_losses(out)
    assert sorted(got) == list(range(8)), (got, log.read_text()[-2000:])
    _assert_losses(got, one_process)


def test_train_killed_at_its_time_limit_says_so_and_keeps_its_checkpoints(
    slurm_cluster, tiny_nemo, train_corpus, tmp_path
):
    """A job past its time limit: the command ends with one line naming TIMEOUT and what to do,
    exit 2, and the checkpoints written are complete. The job goes with `--time 10`, and once its
    first checkpoint is complete its limit is cut to Slurm's shortest (a minute), which ends it as
    `--time 1` would, but never before a checkpoint: a fixed minute from the start left none
    when NeMo started slowly (run 67, four test workers on two cores). One node: the limit ends a
    job whatever its size (two nodes' ranks: the requeue test and the emitted sbatch above)."""
    from porting.testing import checkpoint_complete

    out = tmp_path / "run"
    argv = [*_train_argv(tiny_nemo, train_corpus), "--out", str(out), "--steps", "5000",
            "--save-every", "4", "--nodes", "1", "--gpus-per-node", "1", "--executor", "slurm",
            "--time", "10"]  # fmt: skip
    follower = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=slurm_cluster)  # fmt: skip
    try:
        _wait_for("a complete checkpoint", lambda: checkpoint_complete(out), timeout=TIMEOUT)
        (log,) = (out / "slurm").glob("job-*.out")
        job = log.stem.removeprefix("job-")
        # the command's --time reached Slurm as the job's limit
        assert " TimeLimit=00:10:00 " in _slurm(slurm_cluster, "scontrol", "-o", "show", "job", job)
        _slurm(slurm_cluster, "scontrol", "update", f"jobid={job}", "TimeLimit=1")
        _, stderr = follower.communicate(timeout=TIMEOUT)
    finally:
        follower.kill()
    assert follower.returncode == 2, stderr[-3000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("porting train: error:")]
    assert re.search(r" ended TIMEOUT on node[12] ", line), line
    assert "rerun the same command with a longer --time to resume" in stderr
    assert checkpoint_complete(out)


def _import(hf, out, env, *extra) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "porting.cli", "import", str(hf), "--out", str(out), *extra]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=TIMEOUT)


def test_import_submitted_to_two_nodes_writes_the_one_process_checkpoint(
    slurm_cluster, tiny_llama, tiny_nemo, tmp_path
):
    """`porting import --executor slurm`: torchrun ranks on both nodes meet at the first node's
    NodeAddr, write one checkpoint (the one-process import's tensors bit for bit) and gate it;
    the submitting command prints our lines and the report, and moves the output into place."""
    from porting.testing import assert_same_checkpoint, foreign_lines

    out = tmp_path / "two"
    done = _import(tiny_llama, out, slurm_cluster,
                   "--executor", "slurm", "--nnodes", "2", "--nproc-per-node", "1")  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert re.search(r"submitted Slurm job \d+ \(2 nodes, 1 rank each\)", done.stderr)
    assert "parity PASS" in done.stdout and f"wrote {out} (2 ranks on 2 nodes)" in done.stdout
    assert foreign_lines(done.stdout + done.stderr) == []
    assert_same_checkpoint(tiny_nemo, out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".two.")] == []


def test_an_import_whose_node_goes_down_fails_and_leaves_nothing(
    slurm_cluster, tiny_llama, tmp_path
):
    """A node set down while the import runs: the job is not requeued (its ranks would start over
    into a half-written directory); one line says how it ended, nothing is left. A partition
    that does not exist is refused by sbatch before any rank starts, also leaving nothing."""
    out = tmp_path / "ckpt"
    refused = _import(tiny_llama, out, slurm_cluster, "--executor", "slurm", "--partition", "nope")
    assert refused.returncode == 2
    assert refused.stderr.startswith("porting import: error: sbatch refused the import:")
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    argv = [sys.executable, "-m", "porting.cli", "import", str(tiny_llama), "--out", str(out),
            "--executor", "slurm", "--nnodes", "2", "--nproc-per-node", "1"]  # fmt: skip
    follower = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=slurm_cluster)  # fmt: skip
    try:
        _wait_for("the job to run", lambda: "RUNNING" in _slurm(
            slurm_cluster, "squeue", "-h", "-o", "%T", "-n", "porting-import"))  # fmt: skip
        _slurm(slurm_cluster, "scontrol", "update", "nodename=node2", "state=down",
               "reason=porting-test")  # fmt: skip
        _, stderr = follower.communicate(timeout=TIMEOUT)
    finally:
        follower.kill()
        _wait_for("node2 back", lambda: "down" not in _slurm(
            slurm_cluster, "sinfo", "-h", "-n", "node2", "-o", "%t"), timeout=300)  # fmt: skip
    assert follower.returncode == 2, stderr[-3000:]
    last = stderr.strip().splitlines()
    assert any(
        re.match(r"porting import: error: (Slurm job \d+ ended NODE_FAIL|rank \d )", line)
        for line in last
    ), stderr[-3000:]
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
