"""`porting train` stopped by a signal, in every executor: one line saying what is kept, no
traceback, no process left, ``checkpoints/last`` on a complete checkpoint, nothing unfinished,
no launcher temp directory; a resumed run appends to the metrics history.

Each run is a real `porting train` (NeMo's trainer over gloo) in a session of its own; the signal
goes to the whole group, as a terminal's Ctrl-C or a scheduler's SIGTERM does.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from porting.testing import (
    child_env,
    processes_mentioning,
    run_in_session,
    signal_at_first_checkpoint,
)

TIMEOUT = 300
COMMON = ["--seq-length", "32", "--micro-batch", "2", "--global-batch", "4", "--lr", "1e-2"]


def _argv(ckpt, data, out, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(ckpt),
        "--data", str(data), "--out", str(out), "--save-every", "2", *COMMON, *extra,
    ]  # fmt: skip


def _stopped(argv: list[str], out: Path, sig: int, tmp: Path) -> subprocess.CompletedProcess:
    """The run stopped by ``sig`` at its first checkpoint, with a TMPDIR of its own: torchrun's
    ``torchelastic_*`` directories go there, apart from other runs on the machine."""
    tmp.mkdir()
    return signal_at_first_checkpoint(argv, out, sig, TIMEOUT, env=child_env(TMPDIR=str(tmp)))


def _assert_settled(out: Path, r: subprocess.CompletedProcess, sig: int, tmp: Path) -> None:
    name = signal.Signals(sig).name
    assert r.returncode == 128 + sig, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("porting train:")]
    assert lines == [lines[0]] and lines[0].startswith(f"porting train: stopped by {name}; "), (
        r.stderr[-3000:]
    )
    last = out / "checkpoints" / "last"
    assert f"last complete checkpoint {last} -> " in lines[0]
    target = last.resolve()
    assert target.is_dir() and (target / "context" / "porting.json").is_file()
    assert not list((out / "checkpoints").glob("*-unfinished"))
    assert not list(out.glob(".tmp-launcher-*"))
    assert not list(tmp.glob("torchelastic_*"))
    left = processes_mentioning(str(out), grace=5)
    assert not left, f"processes of the stopped run survive: {left}"


# torchrun's two ranks each settle; NeMo-Run's launcher is torchrun again, so one rank under it
# proves the stop reaches it (a second would cost another NeMo start-up on these two cores)
@pytest.mark.parametrize("executor,ranks", [("torchrun", "2"), ("nemo-run", "1")])
def test_a_stopped_run_leaves_a_resumable_directory_and_no_process(
    executor, ranks, tiny_nemo, train_corpus, tmp_path
):
    out = tmp_path / "run"
    extra = ["--steps", "2000", "--executor", executor, "--gpus-per-node", ranks]
    r = _stopped(_argv(tiny_nemo, train_corpus, out, *extra), out, signal.SIGTERM, tmp_path / "tmp")
    _assert_settled(out, r, signal.SIGTERM, tmp_path / "tmp")


def test_a_run_stopped_by_ctrl_c_settles_and_its_resume_appends_to_the_metrics_history(
    tiny_nemo, train_corpus, tmp_path
):
    """The local executor, stopped by SIGINT as from a terminal: settled as the others are; the
    same command resumed appends to the metrics history, rewriting none of its rows."""
    out = tmp_path / "run"
    argv = _argv(tiny_nemo, train_corpus, out, "--steps", "2000")
    r = _stopped(argv, out, signal.SIGINT, tmp_path / "tmp")
    _assert_settled(out, r, signal.SIGINT, tmp_path / "tmp")
    metrics = out / "csv" / "metrics.csv"
    with open(metrics) as f:
        first = [int(float(row["global_step"])) for row in csv.DictReader(f)]
    resumed_from = int(os.readlink(out / "checkpoints" / "last").split("=")[1].split("-")[0])
    steps = resumed_from + 4
    r = run_in_session(_argv(tiny_nemo, train_corpus, out, "--steps", str(steps)), TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(metrics) as f:
        both = [int(float(row["global_step"])) for row in csv.DictReader(f)]
    assert both[: len(first)] == first, "the rows before the resume were rewritten"
    assert both[len(first) :] == list(range(resumed_from + 1, steps)), both
