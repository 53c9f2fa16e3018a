"""Multi-process `porting train` on the CPU: two gloo processes under `--executor torchrun`.

TP=2 and PP=2 runs (the distributed optimizer on, as by default) are killed with SIGKILL of their
process group right after a checkpoint, re-run, and must continue with the losses of an
uninterrupted one-process run (DP=2's kill and resume is the two-node Slurm run's,
tests/test_slurm.py, in the default DP-reshardable format); checkpoints saved at TP=2 and PP=2 resume in one process (Megatron
reshards the weights and the optimizer state on load); the PP=2 run is the one `porting plan
--emit` wrote for a two-process node, run as emitted, and an uneven pipeline across two sites runs
as emitted too. Every run is a real `porting train` process tree, stopped by a timeout if it hangs.

The slowest tests are marked ``slow`` (``pytest -m "not slow"`` for a quick local subset); CI runs
them all.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from porting.testing import (
    child_env,
    cpu_cluster,
    kill_at_first_checkpoint,
    processes_mentioning,
    run_in_session,
    train_losses,
)

STEPS, SAVE_EVERY = 16, 8
COMMON = [
    "--seq-length", "32", "--micro-batch", "2", "--global-batch", "4", "--lr", "1e-2",
    "--steps", str(STEPS), "--warmup", "2", "--save-every", str(SAVE_EVERY),
]  # fmt: skip
TIMEOUT = 300  # seconds for one run; a hang fails the test instead of blocking CI
TOL = 1e-5


def _argv(ckpt, data, out, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "porting.cli", "train",
        "--checkpoint", str(ckpt), "--data", str(data), "--out", str(out), *COMMON, *extra,
    ]  # fmt: skip


def _two(*extra: str) -> tuple[str, ...]:
    return ("--gpus-per-node", "2", "--executor", "torchrun", *extra)


def _run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` to its end (a hang past TIMEOUT kills its group and fails); it must succeed."""
    r = run_in_session(argv, TIMEOUT, env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def _kill_after_first_checkpoint(argv: list[str], out: Path, env: dict | None = None) -> dict:
    """Start ``argv`` in a session of its own, SIGKILL the whole group as soon as a checkpoint is
    complete, and check that no process of the run survives (torchrun and its ranks run in
    sessions of their own; they die with their parent). Returns the losses logged before."""
    kill_at_first_checkpoint(argv, out, TIMEOUT, env)
    left = processes_mentioning(str(out), grace=10)
    assert not left, f"processes of the killed run survive: {left}"
    # checkpoints/last moves only once a save is complete: it never names an unfinished one
    last = out / "checkpoints" / "last"
    if last.is_symlink():
        assert not last.with_name(os.readlink(last) + "-unfinished").exists()
        assert (last.resolve() / "context" / "porting.json").is_file()
    before = train_losses(out)
    assert max(before, default=-1) < STEPS - 1
    return before


def _assert_sametrain_losses(got: dict, ref: dict, steps, tol: float = TOL) -> None:
    missing = [s for s in steps if s not in got]
    assert not missing, f"steps {missing} not logged"
    diffs = {s: abs(got[s] - ref[s]) for s in steps}
    assert max(diffs.values()) <= tol, {s: f"{d:.2e}" for s, d in diffs.items() if d > tol}


@pytest.fixture(scope="module")
def one_process(tiny_nemo, train_corpus, tmp_path_factory) -> dict[int, float]:
    """The uninterrupted single-process run (TP=PP=DP=1) every layout is held against."""
    out = tmp_path_factory.mktemp("mp") / "one"
    _run(_argv(tiny_nemo, train_corpus, out))
    losses = train_losses(out)
    assert sorted(losses) == list(range(STEPS))
    return losses


# TP's reductions sum in another order than one process: over these 16 steps a TP=2 run's
# losses differ from one process's by up to 7e-6 (measured), so a TP=2 resume is held against one
# process at a tolerance above that. A fresh or mis-sharded Adam state is 1e-2 off from its first
# update on, three orders of magnitude past either tolerance.
TP_TOL = 5e-5

LAYOUTS = {
    # name: (flags, tolerance against one process)
    "tp2": (("--tp", "2", "--optim-fully-reshardable"), TP_TOL),
    "pp2": (("--optim-fully-reshardable",), TOL),  # the plan emitted by _pipeline_plan
}


def _pipeline_plan(tiny_nemo, train_corpus, tmp_path: Path, out: Path) -> tuple[dict, Path, dict]:
    """`porting plan --emit` for a one-node, two-device cluster (PP=2, selective recompute, the
    overlaps): the plan, its emitted directory and the environment its torchrun.sh runs in."""
    from porting.cli import main
    from porting.cpu import free_port

    cluster = cpu_cluster(tmp_path / "pair.yaml", "cpu-pair", {"box": 2})
    emit = tmp_path / "launch"
    argv = ["plan", "--model", str(tiny_nemo), "--cluster", str(cluster), "--global-batch", "4"]
    argv += ["--seq-length", "32", "--layout", "tp=1,pp=2,mb=2,recompute=selective", "--overlap"]
    argv += ["--emit", str(emit), "--data", str(train_corpus), "--out", str(out)]
    assert main(argv) == 0
    flags = shlex.split((emit / "train_flags.txt").read_text())
    assert "--plan" in flags and "--recompute" in flags and "--overlap-grad-reduce" in flags
    bindir = str(Path(sys.executable).parent)
    env = child_env(
        PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    return json.loads((emit / "plan.json").read_text()), emit, env


def _assert_built_as_planned(built: dict, plan: dict) -> None:
    """The trainer built what the plan says: layout, batch, recompute, rank order, optimizer and
    the overlaps."""
    lay, settings = plan["layouts"][0]["layout"], plan["settings"]
    assert (built["tp"], built["pp"], built["cp"], built["dp"]) == (
        lay["tp"], lay["pp"], lay["cp"], lay["dp"]
    )  # fmt: skip
    assert built["vp"] in (None, 1) and lay["vp"] == 1
    assert built["micro_batch"] == lay["micro_batch"] == 2
    assert built["global_batch"] == plan["global_batch"] and built["seq_length"] == 32
    assert built["recompute_granularity"] == lay["recompute"] == "selective"
    assert built["use_tp_pp_dp_mapping"] is (plan["layouts"][0]["rank_order"] == "tp-cp-ep-pp-dp")
    assert built["use_tp_pp_dp_mapping"] is True
    assert built["use_distributed_optimizer"] is settings["distributed_optimizer"] is True
    assert built["num_distributed_optimizer_instances"] == lay["instances"] == 1
    assert built["overlap_grad_reduce"] is settings["overlap_grad_reduce"] is True
    assert built["overlap_param_gather"] is settings["overlap_param_gather"] is True
    assert built["grad_reduce_in_fp32"] is settings["grad_reduce_in_fp32"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_killed_two_process_run_resumes_exactly(
    name, tiny_nemo, train_corpus, one_process, tmp_path
):
    """SIGKILL after the first checkpoint, re-run: every later loss equals the uninterrupted
    one-process run's.

    TP=2 and PP=2 save the distributed optimizer fully reshardable, and their checkpoint also
    resumes in one process (TP=2 -> 1, PP=2 -> 1) with the uninterrupted run's later losses: a
    fresh or mis-sharded Adam state would be 1e-2 off from the first update on.
    PP=2 is the run `porting plan --emit` wrote for a two-device node, its torchrun.sh run as
    emitted (the run's flags appended), both times: the trainer builds what the plan says.
    """
    flags, tol = LAYOUTS[name]
    ref = one_process
    out, env, plan = tmp_path / name, None, None
    if name == "pp2":
        plan, emit, env = _pipeline_plan(tiny_nemo, train_corpus, tmp_path, out)
        argv = ["bash", str(emit / "torchrun.sh"), "0", *COMMON, *flags]
    else:
        argv = _argv(tiny_nemo, train_corpus, out, *_two(*flags))
    before = _kill_after_first_checkpoint(argv, out, env)
    layout = json.loads(
        (out / "checkpoints" / "step=7-last" / "context" / "train_layout.json").read_text()
    )
    assert layout["global_step"] == SAVE_EVERY and layout["distributed_optimizer"] is True
    assert layout["optimizer_format"] == "fully_reshardable"
    shutil.copytree(out, tmp_path / "copy", symlinks=True)

    r = _run(argv, env)
    # resumed, not restarted: the first step it runs is the one after the checkpoint
    said = r.stdout + r.stderr
    assert f"step {SAVE_EVERY + 1}/{STEPS} " in said and f"step 1/{STEPS} " not in said
    after = train_losses(out)
    resumed = range(SAVE_EVERY, STEPS)
    _assert_sametrain_losses(after, ref, resumed, tol)
    _assert_sametrain_losses(before, ref, [s for s in before if s < SAVE_EVERY], tol)
    built = json.loads((out / "run.json").read_text())["built"]
    assert built["world_size"] == 2 and built["optimizer"] == ["DistributedOptimizer"]
    assert (built["tp"], built["pp"], built["dp"]) == {"tp2": (2, 1, 1), "pp2": (1, 2, 1)}[name]
    assert built["megatron_timers"] is False  # the cause of the save hang, gone
    assert (out / "checkpoints" / "last" / "weights" / "metadata.json").exists()
    if plan is not None:
        _assert_built_as_planned(built, plan)

    # the same checkpoint, resumed in one process
    copy = tmp_path / "copy"
    r = _run(_argv(tiny_nemo, train_corpus, copy))
    assert "with a new layout" in r.stderr
    _assert_sametrain_losses(train_losses(copy), ref, resumed, tol)


@pytest.mark.slow
def test_an_uneven_pipeline_across_two_sites_runs_as_emitted(train_corpus, tmp_path):
    """A 3-layer model on two one-process "sites": the plan puts the pipeline across them with
    Megatron's default order and an uneven split (2 layers, then 1); both emitted node commands
    run here as two torchrun nodes, the first stage builds 2 layers, and the losses are those of
    one process."""
    from porting.api import import_hf
    from porting.cli import main
    from porting.cpu import free_port
    from porting.testing import make_llama

    hf = make_llama(tmp_path / "hf3", num_layers=3, rope_theta=50000.0, intermediate_size=98)
    ckpt = tmp_path / "ckpt3"
    import_hf(hf, ckpt, show_progress=False)
    cluster = cpu_cluster(tmp_path / "two-boxes.yaml", "two-boxes", {"a": 1, "b": 1})
    emit, out = tmp_path / "launch", tmp_path / "run"
    argv = ["plan", "--model", str(ckpt), "--cluster", str(cluster), "--global-batch", "4"]
    argv += ["--seq-length", "32", "--layout", "pp=2,mb=2,recompute=none,order=default"]
    argv += ["--emit", str(emit), "--data", str(train_corpus), "--out", str(out)]
    assert main(argv) == 0
    plan = json.loads((emit / "plan.json").read_text())
    lay = plan["layouts"][0]["layout"]
    assert (lay["first_layers"], lay["last_layers"]) == (2, 1)
    assert plan["layouts"][0]["rank_order"] == "tp-cp-ep-dp-pp"

    bindir = str(Path(sys.executable).parent)
    env = child_env(
        PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    more = ["--steps", "6", "--save-every", "0", "--lr", "1e-2", "--warmup", "2"]
    nodes = [
        subprocess.Popen(
            ["bash", str(emit / "torchrun.sh"), str(rank), *more],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [n.communicate(timeout=TIMEOUT)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, 9)
    assert [n.returncode for n in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    # --save-every 0: the closing line says no checkpoint was written, and none was
    assert f"done: 6 steps in {out}, no checkpoint written (--save-every 0)" in logs[0], logs[0][
        -800:
    ]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    built = json.loads((out / "run.json").read_text())["built"]
    assert built["pp"] == 2 and built["use_tp_pp_dp_mapping"] is False
    assert built["num_layers_in_first_pipeline_stage"] == 2
    assert built["num_layers_in_last_pipeline_stage"] == 1
    assert built["layers_built"] == 2

    ref = tmp_path / "one"
    _run(
        [
            sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(ckpt),
            "--data", str(train_corpus), "--out", str(ref), "--seq-length", "32",
            "--micro-batch", "2", "--global-batch", "4", *more,
        ]
    )  # fmt: skip
    _assert_sametrain_losses(train_losses(out), train_losses(ref), range(6))
