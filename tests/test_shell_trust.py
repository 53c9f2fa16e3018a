"""Reliability round five: what we hand to a shell, and what we take from a scheduler.

Every script we write is read back the way its reader reads it (sbatch's directive reader,
bash) and compared with the values that were meant; every value with a control character is
refused by its flag before anything runs; a job is done only when rank 0's verdict says so; a
follower that gives up cancels its job; internal state never comes from a stray variable; a set
of files appears whole or not at all; launch sizes are bounded; no flag is abbreviated.

Each property is proven on the function that decides it, and one case per kind shows that the
command reaches it (in this process; the fakes of ``sbatch``, ``scontrol``, ``scancel`` and
``srun`` are shell scripts on ``PATH`` that record what they were given).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from pathlib import Path

import pytest

from porting import handoff, shell, slurm
from porting.cli import build_parser, main
from porting.errors import PortingError

ROOT = Path(__file__).resolve().parents[1]
ONE_SITE = ROOT / "examples" / "clusters" / "dgx-h100-one-site.yaml"

# Values a user may legitimately give: each must reach its reader unchanged.
HOSTILE = [
    "plain", "two words", "it's", 'say "hi"', "back\\slash", "trail\\", "#hash", "a # b",
    "$(touch PWNED)", "`touch PWNED`", "$HOME", "${x:-y}", "a;b|c&d>e", "*?[x]", "~root",
    "ünïcødé ✓", "%j%%", "-dash", "=eq", "'", '"', "", " lead", "trail ",
]  # fmt: skip
# Every kind of control character: C0 (line ends, NUL, tab, escape), DEL, C1 (NEL, CSI).
CONTROL = ["\n", "\r", "\x00", "\t", "\x0b", "\x0c", "\x1b", "\x7f", "\x85", "\x9b"]


def sbatch_options(script: str) -> list[str]:
    """The options sbatch takes from a script's ``#SBATCH`` lines, read as Slurm reads them
    (``src/sbatch/opt.c``: the header loop stops at the first command, and a line that holds
    ``hetjob`` or ``packjob`` anywhere starts another component of the job, refused here;
    ``_get_argument``: quotes group, a backslash escapes the next character inside quotes too, an
    unquoted ``#`` ends the line, an unmatched quote is an error)."""
    options = []
    for line in script.splitlines()[1:]:
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.lstrip().startswith("#"):
                break
            continue
        if re.search("hetjob|packjob", line, re.IGNORECASE):
            raise ValueError(f"a heterogeneous job's split in {line!r}")
        rest = line[len("#SBATCH") :]
        i = 0
        while True:
            while i < len(rest) and rest[i].isspace():
                i += 1
            if i == len(rest):
                break
            arg, quote, escape = [], None, False
            while i < len(rest) and (quote or not rest[i].isspace()):
                c = rest[i]
                i += 1
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                    continue
                elif quote:
                    if c == quote:
                        quote = None
                        continue
                elif c in "\"'":
                    quote = c
                    continue
                elif c == "#":
                    i = len(rest)
                    break
                arg.append(c)
            if quote:
                raise ValueError(f"unmatched quote in {line!r}")
            if arg:
                options.append("".join(arg))
    return options


def _fake_bin(tmp_path: Path, **bodies: str) -> Path:
    """Shell scripts on PATH standing in for Slurm's clients; each records its argv, one
    NUL-separated record a line, in ``LOG/NAME``."""
    bin_dir = tmp_path / "bin"
    log = tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    log.mkdir(exist_ok=True)
    for name, body in bodies.items():
        path = bin_dir / name
        path.write_text(
            f"#!/bin/bash\nprintf '%s\\0' \"$@\" >> {shell.word(str(log / name), 'log')}\n"
            f"echo >> {shell.word(str(log / name), 'log')}\n{body}\n"
        )
        path.chmod(0o755)
    return bin_dir


def _calls(tmp_path: Path, name: str) -> list[list[str]]:
    path = tmp_path / "calls" / name
    if not path.exists():
        return []
    return [line.split("\0")[:-1] for line in path.read_text().splitlines() if line]


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """``sbatch`` (job 4242), ``scontrol`` (the job COMPLETED), ``scancel`` on PATH; returns a
    function that replaces one's body."""

    def use(**bodies):
        defaults = {
            "sbatch": "echo 4242",
            "scontrol": "echo 'JobId=4242 JobState=COMPLETED NodeList=node1 ExitCode=0:0'",
            "scancel": "exit 0",
        }
        bin_dir = _fake_bin(tmp_path, **(defaults | bodies))
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    use()
    return use


def _porting(monkeypatch, argv: list[str]) -> int:
    """``porting ARGV`` in this process; ``sys.argv`` stays pytest's (a launcher rebuilds its
    ranks' arguments from what was typed, ``args.typed``, not from it)."""
    monkeypatch.setattr(sys, "argv", ["pytest", "-q"])
    return main(argv)


# -- 1. the writer ------------------------------------------------------------------------------


def test_a_directive_reads_back_to_its_value_in_sbatchs_own_reader():
    for value in HOSTILE:
        line = shell.directive("partition", value)
        assert sbatch_options(f"#!/bin/bash\n{line}\necho\n") == [f"--partition={value}"], line
    assert shell.directive("nodes", 2) == "#SBATCH --nodes=2"  # plain words stay plain
    # sbatch starts another component of a heterogeneous job at such a line, quoted or not
    for value in ("gpu-hetjob", "/runs/PackJob 1"):
        with pytest.raises(PortingError, match=r"^--partition: .* heterogeneous job"):
            shell.directive("partition", value)
    # a backslash in an --output name makes Slurm expand no %j
    with pytest.raises(PortingError, match=r"^--out: .* holds a backslash"):
        shell.log_pattern("/runs/a\\b", "job-%j.out", "--out")
    # shlex.quote, what we wrote before, is not sbatch's quoting: the backslash is lost
    assert sbatch_options("#!/bin/bash\n#SBATCH --partition='a\\b'\n") == ["--partition=ab"]


def test_command_words_reach_bash_as_the_values_meant(tmp_path):
    import subprocess

    argv = [*HOSTILE, shell.Ref("HOME")]
    script = f"printf '%s\\0' {shell.command(argv)}"
    ran = subprocess.run(["bash", "-c", script], capture_output=True, cwd=tmp_path, check=True)
    assert ran.stdout.decode().split("\0")[:-1] == [*HOSTILE, os.environ["HOME"]]
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("char", CONTROL, ids=[f"{ord(c):#04x}" for c in CONTROL])
def test_every_control_character_is_refused_by_the_flag_it_came_with(char):
    value = f"/data/run{char}touch /tmp/x"
    for write in (
        lambda: shell.checked(value, "--out"),
        lambda: shell.word(value, "--out"),
        lambda: shell.directive("output", value, "--out"),
        lambda: shell.command(["import", "hf", "--out", value]),
        lambda: shell.command(["import", "hf", f"--out={value}"]),
        lambda: shell.export("X", value, "--out"),
    ):
        with pytest.raises(PortingError, match=r"^--out: .* holds the control character"):
            write()


def test_a_shell_variable_is_a_reference_with_nothing_around_it():
    assert shell.reference_or_value("$DATA", "--data") == shell.Ref("DATA")
    assert shell.reference_or_value('"$DATA"', "--data") == shell.Ref("DATA")
    assert shell.reference_or_value("/data/$weird", "--data") == "/data/$weird"  # a literal
    for bad in ('"$DATA"$(touch X)', '"$DATA', '$DATA"', "$1", "$", '"$A B"', "$A;ls", '"$"'):
        with pytest.raises(PortingError, match=r"^--data: .* begins like a shell variable"):
            shell.reference_or_value(bad, "--data")
    with pytest.raises(PortingError):
        shell.Ref("A B")


def test_a_set_of_files_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    files = {name: (f"{name} v1\n", 0o644) for name in ("a.json", "b.sh", "c.env")}
    new = tmp_path / "emit"
    umask = os.umask(0o022)
    try:
        assert shell.write_set(new, files, "--emit") == [new / n for n in files]
    finally:
        os.umask(umask)
    assert new.stat().st_mode & 0o777 == 0o755  # as mkdir would make it, not mkdtemp's 0700
    (new / "hosts").write_text("mine\n")  # the user's own file beside the set
    v2 = {name: (f"{name} v2\n", 0o755) for name in files}
    shell.write_set(new, v2, "--emit")
    assert {p.name: p.read_text() for p in new.iterdir()} == {
        "a.json": "a.json v2\n", "b.sh": "b.sh v2\n", "c.env": "c.env v2\n", "hosts": "mine\n",
    }  # fmt: skip
    assert (new / "b.sh").stat().st_mode & 0o777 == 0o755

    # the disk fills at the second file: none of the set is new, in a new or an existing place
    write = Path.write_text

    def full(self, text, *a, **k):
        if self.name == "b.sh":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    v3 = {name: (f"{name} v3\n", 0o644) for name in files}
    for target in (new, tmp_path / "fresh", tmp_path / "p" / "q" / "emit"):
        with pytest.raises(PortingError) as err:
            shell.write_set(target, v3, "--emit")
        assert str(err.value) == (
            f"--emit {target}: no space left on the device writing b.sh; nothing was written"
        )
    assert {p.name: p.read_text() for p in new.iterdir()}["a.json"] == "a.json v2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emit"]
    assert sorted(p.name for p in new.iterdir()) == ["a.json", "b.sh", "c.env", "hosts"]


def test_a_set_whose_swap_fails_puts_the_old_files_back(tmp_path, monkeypatch):
    files = {name: (f"{name} v1\n", 0o644) for name in ("a", "b", "c")}
    shell.write_set(tmp_path / "d", files, "--emit")
    replace = os.replace

    def failing(src, dst):
        if Path(dst) == tmp_path / "d" / "c" and Path(src).parent.name != ".aside":
            raise OSError(errno.EIO, "Input/output error")
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(PortingError, match="Input/output error; nothing was written"):
        shell.write_set(tmp_path / "d", {n: ("v2\n", 0o644) for n in files}, "--emit")
    assert {p.name: p.read_text() for p in (tmp_path / "d").iterdir()} == {
        n: f"{n} v1\n" for n in files
    }


# -- 2. every emitted script, read back ---------------------------------------------------------


def test_a_conversions_job_script_runs_exactly_the_meant_command(tmp_path):
    """The batch script of ``--executor slurm`` read by sbatch's reader (the options meant) and
    run by bash with a fake ``srun`` (the argv and the handed-over state meant)."""
    import subprocess

    argv = ["import", "/hf dir/it's", "--out", "/ck $(touch PWNED)", "--dtype", "`id`"]
    logs = tmp_path / "logs %j"
    script = slurm.torchrun_script(
        "porting-import", 2, 3, logs, argv, partition="gpu 'a'", time_limit="1:00:00",
        switches=("no-requeue",), exports={"PORTING_RANKS_STAGING": ('{"dir": "/x y"}', "--out")},
        share_cores=True,
    )  # fmt: skip
    assert sbatch_options(script) == [
        "--job-name=porting-import", "--nodes=2", "--ntasks-per-node=1", "--exclusive",
        f"--output={tmp_path}/logs %%j/job-%j.out", "--partition=gpu 'a'", "--time=1:00:00",
        "--no-requeue",
    ]  # fmt: skip
    bin_dir = _fake_bin(
        tmp_path,
        scontrol='case "$1 $2" in "show hostnames") printf "node1\\nnode2\\n" ;; '
        '"show node") [ "$3" = node1 ] && echo "NodeName=node1 NodeAddr=10.0.0.1" ;; esac',
        srun='printf "%s\\0" "$PORTING_RANKS_STAGING" "$OMP_NUM_THREADS" "$TORCH_LOGS" '
        '"$TORCH_CPP_LOG_LEVEL" >> "$RECORD"',
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node1", "RECORD": str(tmp_path / "env")}  # fmt: skip
    # what the script decides itself
    for inherited in ("OMP_NUM_THREADS", "MASTER_PORT", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL"):
        env.pop(inherited, None)
    ran = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True)
    assert ran.returncode == 0, ran.stderr
    assert _calls(tmp_path, "srun") == [[
        "bash", "-c", slurm.PRIVATE_TMPDIR, "porting-rank",
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=3",
        "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:20007", "--rdzv-id=7",
        "-m", "porting.cli", *argv,
    ]]  # fmt: skip
    staging, threads, elastic, cpp = (tmp_path / "env").read_text().split("\0")[:4]
    assert staging == '{"dir": "/x y"}' and int(threads) >= 1
    # torch's rendezvous-teardown warnings kept out of a succeeded job's log
    assert (elastic, cpp) == ("-distributed", "ERROR")
    assert not (tmp_path / "PWNED").exists()
    # what srun runs on each node: the command under a TMPDIR of its own, gone after it, also
    # when the command fails
    for code in (0, 3):
        node_tmp = tmp_path / f"node-tmp-{code}"
        node_tmp.mkdir()
        ran = subprocess.run(
            ["bash", "-c", slurm.PRIVATE_TMPDIR, "porting-rank", "sh", "-c",
             f'echo "$TMPDIR"; touch "$TMPDIR/torchelastic_x"; exit {code}'],
            env={**os.environ, "TMPDIR": str(node_tmp)}, capture_output=True, text=True,
        )  # fmt: skip
        assert ran.returncode == code
        assert Path(ran.stdout.strip()).parent == node_tmp and list(node_tmp.iterdir()) == []


def test_prep_datas_scripts_read_back_to_the_meant_values(tmp_path):
    from data_prep import testing as T
    from data_prep.run import prepare

    tok = T.train_hf_bpe(T.synthetic_texts(40, seed=3), tmp_path / "tok", 300)
    data = T.write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in T.synthetic_texts(30)])
    emit = tmp_path / "emit 'it's' %x"
    cfg = T.prep_config([data], tmp_path / "out", tok, executor="slurm", emit=str(emit),
                        no_submit=True, partition='p "q"', time_limit="10")  # fmt: skip
    prepare(cfg)
    units = (emit / "units.sbatch").read_text()
    assert sbatch_options(units) == [
        "--job-name=prep-data-units", "--array=0-0", "--cpus-per-task=1",
        f"--output={str(emit).replace('%', '%%')}/logs/unit-%a.out", '--partition=p "q"',
        "--time=10",
    ]  # fmt: skip
    command = units.strip().splitlines()[-1]
    import shlex

    assert shlex.split(command.replace('"$SLURM_ARRAY_TASK_ID"', "TASK")) == [
        "exec", sys.executable, "-m", "porting.cli", "prep-data", "run-unit", "--job",
        str(emit / "job.json"), "--unit", "TASK",
    ]  # fmt: skip
    assert sorted(p.name for p in emit.iterdir()) == [
        "job.json", "logs", "merge.sbatch", "submit.sh", "units.sbatch",
    ]  # fmt: skip


# -- 3. each command refuses a control character by its flag, before anything runs --------------


@pytest.mark.parametrize("flag", ["--out", "--partition", "--time"])
def test_an_import_to_slurm_refuses_a_newline_by_flag_and_submits_nothing(
    flag, fakes, tiny_llama, tmp_path, monkeypatch, capsys
):
    values = {"--out": str(tmp_path / "ck"), "--partition": "gpu", "--time": "10"}
    values[flag] += "\ntouch /tmp/porting-pwned"
    argv = ["import", str(tiny_llama), "--executor", "slurm"]
    argv += [a for f, v in values.items() for a in (f, v)]
    assert _porting(monkeypatch, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"porting import: error: {flag}: ") and "control character" in err
    assert _calls(tmp_path, "sbatch") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "calls"]


def test_prep_data_refuses_a_newline_in_its_emit_directory_by_flag(tmp_path, monkeypatch):
    from data_prep import testing as T
    from data_prep.run import prepare

    tok = T.train_hf_bpe(T.synthetic_texts(40, seed=3), tmp_path / "tok", 300)
    data = T.write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    for flag, kw in (
        ("--emit", {"output_prefix": tmp_path / "out", "emit": str(tmp_path / "e\nrm -rf ~")}),
        ("--output-prefix", {"output_prefix": tmp_path / "o\nrm -rf ~"}),
        ("--partition", {"output_prefix": tmp_path / "out", "partition": "a\nb"}),
    ):
        prefix = kw.pop("output_prefix")
        cfg = T.prep_config([data], prefix, tok, executor="slurm", no_submit=True, **kw)
        with pytest.raises(PortingError, match=rf"^{flag}: .* control character"):
            prepare(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "tok"]


def test_train_to_slurm_refuses_a_newline_by_flag(fakes, tiny_nemo, tmp_path, monkeypatch, capsys):
    base = ["train", "--checkpoint", str(tiny_nemo), "--data", str(tmp_path / "d"),
            "--executor", "slurm", "--no-submit"]  # fmt: skip
    for flag, argv in (
        ("--out", ["--out", str(tmp_path / "run\nid")]),
        ("--partition", ["--out", str(tmp_path / "run"), "--partition", "a\rb"]),
        ("--time", ["--out", str(tmp_path / "run"), "--time", "1\x00"]),
    ):
        assert _porting(monkeypatch, [*base, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"porting train: error: {flag}") and "control character" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "calls"]


def test_plans_emitted_scripts_take_variables_only_as_references(tmp_path, monkeypatch, capsys):
    import subprocess

    base = ["plan", "--model", "llama-7b", "--cluster", str(ONE_SITE), "--global-batch", "64",
            "--seq-length", "4096", "--layout", "tp=8,pp=1,cp=1,mb=1"]  # fmt: skip
    out = tmp_path / "emit"
    for bad in ('"$DATA"$(touch X)', '"$DATA', "$DATA;id", "/d\n/e"):
        assert _porting(monkeypatch, [*base, "--emit", str(out), "--data", bad]) == 2
        assert capsys.readouterr().err.startswith("porting plan: error: --data: ")
    assert not out.exists()

    checkpoint = "/ck/it's $(touch PWNED) `id`"
    argv = [*base, "--emit", str(out), "--data", "$DATA", "--checkpoint", checkpoint]
    assert _porting(monkeypatch, argv) == 0
    bin_dir = _fake_bin(tmp_path, torchrun="true")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MASTER_ADDR": "h0",
           "DATA": "/data/$(touch PWNED2)", "OUT": "/runs/x"}  # fmt: skip
    ran = subprocess.run(["bash", str(out / "torchrun.sh"), "0"], env=env, capture_output=True,
                         cwd=tmp_path)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    (call,) = _calls(tmp_path, "torchrun")
    flags = call[call.index("train") + 1 :]
    assert flags[:6] == ["--checkpoint", checkpoint, "--data", "/data/$(touch PWNED2)",
                         "--out", "/runs/x"]  # fmt: skip
    import shlex

    assert shlex.split((out / "train_flags.txt").read_text())[:6] == [
        "--checkpoint", checkpoint, "--data", "$DATA", "--out", "$OUT",
    ]  # fmt: skip
    assert not list(tmp_path.glob("PWNED*"))


def test_plan_emit_on_a_full_disk_leaves_no_file_of_the_set(tmp_path):
    """A real full disk (a small tmpfs): no file of the set appears, the message names the file
    and the directory; over an existing emit directory the old set stays whole."""
    from porting.testing import on_a_small_disk

    out = tmp_path / "disk" / "emit"
    argv = [sys.executable, "-m", "porting.cli", "plan", "--model", "llama-7b", "--cluster",
            str(ONE_SITE), "--global-batch", "64", "--seq-length", "4096", "--emit", str(out)]  # fmt: skip
    code, err, left = on_a_small_disk("12k", argv, out)
    assert code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"porting plan: error: --emit {out}: no space left on the device "
                           "writing ") and last.endswith("; nothing was written"), err[-2000:]  # fmt: skip
    assert left == [], left


# -- 4. a job is done when its verdict says so; a follower that gives up cancels -------------


def test_a_completed_job_without_rank_0s_report_is_not_a_success(tmp_path):
    from porting.convert import ranks

    stage = tmp_path / "stage"
    (stage / ranks.RANKS_DIR).mkdir(parents=True)
    with pytest.raises(PortingError, match=r"^Slurm job 7 completed but rank 0 left no report"):
        ranks.report_of(stage, "7")
    with pytest.raises(PortingError, match="file system that every node sees"):
        ranks.report_of(stage)
    (stage / ranks.RANKS_DIR / "verdict").write_text("yes\n")
    (stage / ranks.RANKS_DIR / "report.out").write_text("")
    with pytest.raises(PortingError, match="not a verdict"):
        ranks.report_of(stage)
    (stage / ranks.RANKS_DIR / "verdict").write_text("failed\n")
    assert ranks.report_of(stage) == ("", False)
    assert list(stage.iterdir()) == []


def test_import_under_slurm_that_completed_without_its_ranks_is_refused(
    fakes, tiny_llama, tmp_path, monkeypatch, capsys
):
    """What a node-local output does for real: the job COMPLETED, rank 0's report is nowhere
    the submitter can see."""
    out = tmp_path / "ck"
    assert _porting(monkeypatch, ["import", str(tiny_llama), "--out", str(out), "--executor",
                                  "slurm", "--nnodes", "1", "--nproc-per-node", "1"]) == 2  # fmt: skip
    said = capsys.readouterr()
    assert "submitted Slurm job 4242" in said.err
    assert (
        said.err.strip()
        .splitlines()[-1]
        .startswith("porting import: error: Slurm job 4242 completed but rank 0 left no report")
    ), said.err
    assert "wrote" not in said.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "calls"]


def test_verify_under_slurm_that_completed_without_its_ranks_fails(
    fakes, tiny_llama, tiny_nemo, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    argv = ["verify", str(tiny_llama), str(tiny_nemo), "--executor", "slurm", "--nnodes", "1",
            "--nproc-per-node", "1"]  # fmt: skip
    assert _porting(monkeypatch, argv) == 2
    said = capsys.readouterr()
    assert "Slurm job 4242 completed but rank 0 left no report" in said.err
    assert "PASS" not in said.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "calls"]


def test_a_controller_that_stops_answering_ends_with_the_job_cancelled(
    fakes, tiny_llama, tmp_path, monkeypatch, capsys
):
    fakes(
        scontrol="echo 'slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1"
    )
    monkeypatch.setattr(slurm, "PATIENCE_S", 0.3)
    out = tmp_path / "ck"
    argv = ["import", str(tiny_llama), "--out", str(out), "--executor", "slurm", "--nnodes", "1"]
    assert _porting(monkeypatch, argv) == 2
    err = capsys.readouterr().err
    assert "Socket timed out" in err, err
    assert err.strip().splitlines()[-1].startswith("Slurm job 4242 cancelled (Slurm did not say")
    assert _calls(tmp_path, "scancel") == [["4242"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "calls"]


def test_following_survives_a_busy_controller_and_cancels_only_what_it_abandons(
    fakes, tmp_path, monkeypatch
):
    answers = iter([slurm.Unreachable("Socket timed out")] * 3 + [False, True])

    def poll():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    slurm.follow(["1"], poll, poll_s=0.01, patience_s=5)
    assert _calls(tmp_path, "scancel") == []

    def ended():
        raise slurm.JobEnded("job 2 ended FAILED")

    with pytest.raises(slurm.JobEnded):
        slurm.follow(["2"], ended, poll_s=0.01)
    assert _calls(tmp_path, "scancel") == []  # nothing left to cancel

    def broken():
        raise PortingError("scontrol not found on PATH")

    with pytest.raises(PortingError, match=r"not found on PATH\nSlurm job 3 cancelled$"):
        slurm.follow(["3"], broken, poll_s=0.01)

    def stopped():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as stop:
        slurm.follow(["4"], stopped, poll_s=0.01)
    assert stop.value.kept == "Slurm job 4 cancelled"
    assert _calls(tmp_path, "scancel") == [["3"], ["4"]]
    fakes(scancel="echo 'scancel: error: Socket timed out' >&2; exit 1")
    assert "run scancel 5 by hand" in slurm.cancel(["5"])


def test_train_under_slurm_is_done_only_with_rank_0s_verdict(fakes, tmp_path, monkeypatch):
    from porting.train import launch

    run = tmp_path / "run"
    log = run / "slurm" / "job-4242.out"
    log.parent.mkdir(parents=True)
    log.write_text("done: checkpoints in somewhere\n")  # a log line proves nothing
    with pytest.raises(slurm.JobEnded, match=r"^Slurm job 4242 completed but rank 0 left no "):
        launch.follow_slurm("4242", log, poll_s=0.01, out=run)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    launch.leave_verdict(run, "done: 3 steps")
    launch.follow_slurm("4242", log, poll_s=0.01, out=run)
    assert launch.verdict_path(run, "4242").read_text() == "done: 3 steps\n"


def test_a_prep_data_submission_that_cannot_be_recorded_cancels_its_jobs(
    fakes, tmp_path, monkeypatch
):
    from data_prep import slurm as prep_slurm
    from data_prep import testing as T
    from data_prep.run import prepare

    tok = T.train_hf_bpe(T.synthetic_texts(40, seed=3), tmp_path / "tok", 300)
    data = T.write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in T.synthetic_texts(30)])
    ids = iter(["11", "12"])
    monkeypatch.setattr(slurm, "sbatch", lambda argv, what: next(ids))

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prep_slurm, "write_json_atomic", full)
    cfg = T.prep_config([data], tmp_path / "out", tok, executor="slurm", no_wait=True)
    with pytest.raises(OSError):
        prepare(cfg)
    assert _calls(tmp_path, "scancel") == [["11", "12"]]


# -- 5. internal state never comes from the environment -----------------------------------------


def test_a_handed_over_state_needs_its_launchs_token(tmp_path, monkeypatch):
    env = handoff.hand_off("PORTING_X", tmp_path, stage="/s")
    monkeypatch.setenv("PORTING_X", env["PORTING_X"])
    assert handoff.received("PORTING_X")["stage"] == "/s"
    ended = tmp_path / "ended"
    ended.mkdir()
    monkeypatch.setenv("PORTING_X", handoff.hand_off("PORTING_X", ended)["PORTING_X"])
    assert handoff.received("PORTING_X") is not None
    (ended / handoff.TOKEN_FILE).unlink()  # the launch is over: the same value no longer holds
    with pytest.raises(PortingError, match="does not see the launch's directory"):
        handoff.received("PORTING_X")
    monkeypatch.setenv("PORTING_X", env["PORTING_X"])
    strays = [
        str(tmp_path),  # a path, as an older sbatch script exported it
        "garbage",
        json.dumps({"dir": str(tmp_path), "token": "0" * 32}),
        json.dumps({"dir": "relative", "token": json.loads(env["PORTING_X"])["token"]}),
        json.dumps([1]),
    ]
    (tmp_path / "gone").mkdir()
    strays.append(handoff.hand_off("PORTING_X", tmp_path / "gone")["PORTING_X"])
    (tmp_path / "gone" / handoff.TOKEN_FILE).unlink()  # the launch is over
    for value in strays:
        monkeypatch.setenv("PORTING_X", value)
        with pytest.raises(PortingError, match=r"^PORTING_X is set in this environment, but no "):
            handoff.received("PORTING_X")
    monkeypatch.delenv("PORTING_X")
    assert handoff.received("PORTING_X") is None


def test_a_stray_staging_variable_is_refused_by_name_and_writes_nowhere(
    tiny_llama, tmp_path, monkeypatch, capsys
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("PORTING_RANKS_STAGING", str(elsewhere))
    out = tmp_path / "ck"
    assert _porting(monkeypatch, ["import", str(tiny_llama), "--out", str(out), "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("porting import: error: PORTING_RANKS_STAGING is set in this environment")
    assert "unset PORTING_RANKS_STAGING" in err
    assert not out.exists() and list(elsewhere.iterdir()) == []


def test_a_stray_rank_in_one_process_is_refused_by_name(
    tiny_llama, tiny_nemo, train_corpus, tmp_path, monkeypatch, capsys
):
    """torchrun's RANK left in a shell: one process would take itself for rank 1 (a conversion
    would leave out its manifest, a training run its lock and its verdict)."""
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "ck"
    assert _porting(monkeypatch, ["import", str(tiny_llama), "--out", str(out), "--no-verify"]) == 2
    assert capsys.readouterr().err.startswith("porting import: error: RANK=1 is set in this ")
    argv = ["train", "--checkpoint", str(tiny_nemo), "--data", str(train_corpus), "--out",
            str(tmp_path / "run"), "--steps", "1"]  # fmt: skip
    assert _porting(monkeypatch, argv) == 2
    assert capsys.readouterr().err.startswith("porting train: error: RANK=1 is set in this ")
    assert list(tmp_path.iterdir()) == []


def test_a_stray_train_launcher_variable_is_refused_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PORTING_TRAIN_LAUNCHER", "1:0.0")
    argv = ["train", "--checkpoint", str(tmp_path / "c"), "--data", str(tmp_path / "d"), "--out",
            str(tmp_path / "run")]  # fmt: skip
    assert _porting(monkeypatch, argv) == 2
    assert capsys.readouterr().err.startswith(
        "porting train: error: PORTING_TRAIN_LAUNCHER is set in this environment"
    )
    assert list(tmp_path.iterdir()) == []


# -- 6. launch sizes, whole flags, plan.json ----------------------------------------------------


def test_launch_sizes_no_node_can_schedule_are_refused():
    cores = len(os.sched_getaffinity(0))
    refused = [
        ((0, 1, False), "--nnodes must be at least 1"),
        ((1, 0, False), "--nproc-per-node must be at least 1"),
        ((slurm.MAX_NODES + 1, 1, False), f"--nnodes {slurm.MAX_NODES + 1} is more than"),
        ((1, 1_000_000, False), "--nproc-per-node 1000000 is more than the limit of 1024"),
        ((1, cores + 1, True), f"this node can run {cores} process"),
    ]
    for (nodes, ranks, local), said in refused:
        with pytest.raises(PortingError, match=said):
            slurm.check_launch_size(nodes, ranks, local=local, nodes_flag="--nnodes",
                                    ranks_flag="--nproc-per-node")  # fmt: skip
    slurm.check_launch_size(slurm.MAX_NODES, 1024, local=False, nodes_flag="-", ranks_flag="-")
    from porting.planner import limits

    assert (slurm.MAX_NODES, slurm.MAX_RANKS_PER_NODE) == (
        limits.MAX_GPUS,
        limits.MAX_GPUS_PER_NODE,
    )


def test_each_launching_command_reaches_the_size_check(tiny_llama, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "x")
    for argv, said in (
        (["import", str(tiny_llama), "--out", out, "--executor", "torchrun", "--nproc-per-node",
          "1000000"], "porting import: error: --nproc-per-node 1000000"),
        (["train", "--checkpoint", str(tiny_llama), "--data", "d", "--out", out, "--executor",
          "torchrun", "--gpus-per-node", "1000"], "porting train: error: --gpus-per-node 1000"),
    ):  # fmt: skip
        assert _porting(monkeypatch, argv) == 2
        assert capsys.readouterr().err.startswith(said)
    assert list(tmp_path.iterdir()) == []


def test_no_parser_takes_an_abbreviated_flag(tiny_llama, tmp_path):
    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    assert all(not p.allow_abbrev for p in parsers(build_parser()))
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["import", str(tiny_llama), "--out", "x", "--exec", "torchrun"])
    assert exit_.value.code == 2


def test_a_malformed_plan_json_is_refused_by_field(tmp_path):
    from porting.train import checks, plan_check

    plan = {"model": {"hidden": 64}, "layouts": [{"layout": {"tp": 1}}], "settings": {}}
    spec = checks.TrainSpec(checkpoint=str(tmp_path), data=[], out=str(tmp_path / "o"))
    for edit, field, kind in (
        (lambda p: p["layouts"].__setitem__(0, "tp=1"), "layouts[0]", "an object"),
        (lambda p: p["layouts"][0]["layout"].__setitem__("tp", True), "layouts[0].layout.tp",
         "an integer"),
        (lambda p: p["layouts"][0].__setitem__("layout", [1]), "layouts[0].layout", "an object"),
        (lambda p: p["settings"].__setitem__("overlap_grad_reduce", "yes"),
         "settings.overlap_grad_reduce", "true/false"),
        (lambda p: p["model"].__setitem__("hidden", 64.0), "model.hidden", "an integer"),
        (lambda p: p.__setitem__("settings", []), "settings", "an object"),
    ):  # fmt: skip
        bad = json.loads(json.dumps(plan))
        edit(bad)
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(bad))
        spec.plan = path
        said = rf"plan.json: {re.escape(field)} is .*, not {kind}"
        with pytest.raises(PortingError, match=said):
            plan_check.check_plan(spec, None, None)
