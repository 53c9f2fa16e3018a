"""Our commands print our lines only; a library's real error still reaches the user.

Each command runs as a user runs it (a subprocess, no -v) on a tiny model, and every line of its
stdout and stderr must be one of ours (``porting.testing.OWN_OUTPUT_PATTERNS``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from porting.testing import foreign_lines

CORPUS = [
    {"text": f"The quick brown fox jumps over the lazy dog {i}. 東京は日本の首都です。"}
    for i in range(60)
]


def _porting(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "porting.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def _assert_ours(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert foreign_lines(proc.stdout + proc.stderr) == []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_llama, tiny_nemo):
    d = tmp_path_factory.mktemp("quiet")
    (d / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    return d


def test_import_verify_export_print_only_our_lines(workdir, tiny_llama):
    _assert_ours(_porting("import", str(tiny_llama), "--out", "ckpt", cwd=workdir))
    _assert_ours(_porting("verify", str(tiny_llama), "ckpt", cwd=workdir))
    _assert_ours(_porting("export", "ckpt", "--out", "hf-back", cwd=workdir))


def test_the_megatron_layouts_print_only_our_lines(workdir, tiny_llama):
    """import --format, convert between layouts (two labelled reports), verify and export."""
    _assert_ours(
        _porting("import", str(tiny_llama), "--out", "mlm", "--format", "megatron-lm", cwd=workdir)
    )
    convert = _porting("convert", "mlm", "--to", "megatron-bridge", "--out", "bridge", cwd=workdir)
    _assert_ours(convert)
    assert "export (mlm -> HF):" in convert.stdout
    assert "import (HF -> megatron-bridge):" in convert.stdout
    _assert_ours(_porting("verify", str(tiny_llama), "bridge", cwd=workdir))
    _assert_ours(_porting("export", "bridge", "--out", "bridge-hf", cwd=workdir))


def test_demo_prints_only_our_lines(workdir):
    proc = _porting("demo", "--workdir", "demo", cwd=workdir)
    _assert_ours(proc)
    assert "OK: outputs in" in proc.stdout


def test_prep_data_and_train_print_only_our_lines(workdir, tiny_nemo):
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
        cwd=workdir,
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
    )
    _assert_ours(train)
    assert "step 3/3" in train.stderr


def test_verbose_brings_the_hidden_lines_back(workdir, tiny_llama):
    proc = _porting("-v", "verify", str(tiny_llama), "ckpt", cwd=workdir)
    assert proc.returncode == 0
    assert foreign_lines(proc.stdout + proc.stderr) != []


def test_the_foreign_line_finder_is_not_blind():
    assert foreign_lines("GPU available: False, used: False\nwrote x\n") == [
        "GPU available: False, used: False"
    ]


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
