"""Our commands print our lines only; a library's real error still reaches the user.

Each command runs as a user runs it (a subprocess, no -v) on a tiny model, and every line of its
stdout and stderr must be one of ours (``porting.testing.OWN_OUTPUT_PATTERNS``). The conversions
and the demo run on the current stack, where users are; NeMo 2's training and NeMo's own errors
on the NeMo 2 stack (``nemo2``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from porting.testing import foreign_lines

CORPUS = [
    {"text": f"The quick brown fox jumps over the lazy dog {i}. 東京は日本の首都です。"}
    for i in range(60)
]


@pytest.fixture(scope="module")
def slurm_host(tmp_path_factory) -> dict:
    """The environment of a Slurm login node: ``srun`` on the PATH (Lightning's cue to print its
    "`srun` is available but not used" hint). Every command here runs in it: a line that shows
    on such a host is shown to every Slurm user."""
    bin_dir = tmp_path_factory.mktemp("slurm-bin")
    for tool in ("srun", "sbatch", "squeue"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    # PYTHONWARNINGS is what quiet.install set in this process (tests call main() in-process); a
    # user's shell does not carry it, and -v must be seen to bring the hint back without it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _porting(*args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "porting.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        env=env,
    )


def _assert_ours(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert foreign_lines(proc.stdout + proc.stderr) == []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_llama, tiny_nemo, slurm_host):
    d = tmp_path_factory.mktemp("quiet")
    (d / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    return d


def test_import_verify_export_print_only_our_lines(workdir, tiny_llama, slurm_host):
    imported = _porting("import", str(tiny_llama), "--out", "ckpt", cwd=workdir, env=slurm_host)
    _assert_ours(imported)
    # the import's summary is a line of ours, not a logger's record
    (summary,) = [x for x in imported.stderr.splitlines() if "HF tensors ->" in x]
    assert summary.startswith(f"imported {tiny_llama} ("), summary
    assert not [x for x in imported.stdout.splitlines() if x.startswith("INFO ")]
    assert not [x for x in imported.stderr.splitlines() if x.startswith("INFO ")]
    _assert_ours(_porting("verify", str(tiny_llama), "ckpt", cwd=workdir, env=slurm_host))
    _assert_ours(_porting("export", "ckpt", "--out", "hf-back", cwd=workdir, env=slurm_host))


# `sbatch --ntasks=4` running `porting import` in its script: Lightning would take the
# allocation's four tasks as the world (or refuse `--ntasks`); a conversion is one process.
ALLOCATION = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NAME": "convert",
    "SLURM_NTASKS": "4",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


def test_the_megatron_layouts_print_only_our_lines(workdir, tiny_llama, slurm_host):
    """import --format and convert between layouts (two labelled reports) inside a Slurm
    allocation, where each is still one local process; verify and export on the login node."""
    in_job = slurm_host | ALLOCATION
    _assert_ours(
        _porting(
            "import", str(tiny_llama), "--out", "mlm", "--format", "megatron-lm",
            cwd=workdir, env=in_job,
        )
    )  # fmt: skip
    assert (workdir / "mlm" / "latest_checkpointed_iteration.txt").is_file()
    convert = _porting(
        "convert", "mlm", "--to", "megatron-bridge", "--out", "bridge", cwd=workdir, env=in_job
    )
    _assert_ours(convert)
    assert "export (mlm -> HF):" in convert.stdout
    assert "import (HF -> megatron-bridge):" in convert.stdout
    _assert_ours(_porting("verify", str(tiny_llama), "bridge", cwd=workdir, env=slurm_host))
    _assert_ours(_porting("export", "bridge", "--out", "bridge-hf", cwd=workdir, env=slurm_host))


def test_demo_prints_only_our_lines(workdir, slurm_host):
    proc = _porting("demo", "--workdir", "demo", cwd=workdir, env=slurm_host)
    _assert_ours(proc)
    assert "OK: outputs in" in proc.stdout


# NeMo 2's loop; Bridge's run prints our lines only too (tests/test_train_bridge.py)
@pytest.mark.nemo2
def test_prep_data_and_train_print_only_our_lines(workdir, tiny_nemo, slurm_host):
    prep = _porting(
        "prep-data",
        "--input",
        "corpus.jsonl",
        "--output-prefix",
        "data/c",
        "--tokenizer",
        str(tiny_nemo),
        "--json-keys",
        "text",
        "--append-eod",
        "--workers",
        "1",
        # a user's first run on a tokenizer: Megatron's tokenizer loads in a process of its own
        "--recheck-tokenizer",
        cwd=workdir,
        env=slurm_host,
    )
    _assert_ours(prep)
    train = _porting(
        "train",
        "--checkpoint",
        str(tiny_nemo),
        "--data",
        "data/c_text_document",
        "--out",
        "run",
        "--seq-length",
        "32",
        "--global-batch",
        "2",
        "--steps",
        "3",
        "--save-every",
        "2",
        "--no-distributed-optimizer",
        cwd=workdir,
        env=slurm_host,
    )
    _assert_ours(train)
    assert "step 3/3" in train.stderr


def test_verbose_brings_the_hidden_lines_back(workdir, tiny_llama, slurm_host):
    proc = _porting("-v", "import", str(tiny_llama), "--out", "ckpt-v", cwd=workdir, env=slurm_host)
    assert proc.returncode == 0
    hidden = foreign_lines(proc.stdout + proc.stderr)
    # one of each kind quiet hides: a Python warning and a library's log record (Megatron-Core's,
    # on a machine without Apex; the import no longer starts Lightning, whose srun hint was one)
    assert any("Falling back to Torch Norm" in line for line in hidden), hidden
    assert any(line.startswith("WARNING megatron.core.") for line in hidden), hidden


def test_the_foreign_line_finder_is_not_blind():
    assert foreign_lines("GPU available: False, used: False\nwrote x\n") == [
        "GPU available: False, used: False"
    ]


@pytest.mark.nemo2
def test_an_error_inside_nemo_still_reaches_the_user(tmp_path):
    code = (
        "from porting import quiet\n"
        "quiet.install(False)\n"
        "from nemo.utils import logging\n"
        "logging.error('an error NeMo logs')\n"
        "from nemo.lightning.io import load_context\n"
        f"load_context({str(tmp_path / 'no-such-context')!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "an error NeMo logs" in proc.stderr
    assert "Traceback" in proc.stderr and "no-such-context" in proc.stderr
