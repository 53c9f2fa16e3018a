"""How fast the CLI answers: wall time, time to its first line, and peak memory, per command.

Each command runs as a user runs it (the ``porting`` console script, a fresh process), three times;
the table shows the median. The refusals need no model: a missing directory, an unknown
architecture, a hostile config value, an output that exists, a verify of another model's files.
``verify`` runs on a tiny imported Llama (built here, no hub) and is reported with the time to
its first line and its whole wall.

    python scripts/bench_cli.py [--repeat N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PORTING = str(Path(sys.executable).with_name("porting"))


def _run(argv: list[str]) -> tuple[float, float, int]:
    """(wall s, first output line s, exit code) of one ``porting`` process."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [PORTING, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    first: list[float] = []

    def read() -> None:
        for _ in proc.stdout:
            if not first:
                first.append(time.perf_counter() - start)

    reader = threading.Thread(target=read)
    reader.start()
    code = proc.wait()
    reader.join()
    wall = time.perf_counter() - start
    return wall, first[0] if first else wall, code


def _peak_mb(argv: list[str]) -> float:
    """Peak RSS of one run of ``porting argv``, from wait4's rusage (KB on Linux)."""
    proc = subprocess.Popen([PORTING, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss / 1024


def _tiny_checkpoint(work: Path) -> tuple[Path, Path]:
    """A tiny imported Llama, made in a child process: this one stays small, so that the
    commands' peak memory (which a fork starts from) is theirs."""
    hf, ckpt = work / "hf", work / "nemo"
    if not (ckpt / "context").exists():
        code = (
            "import sys; from porting.api import import_hf; from porting.testing import make_llama;"
            "import_hf(make_llama(sys.argv[1]), sys.argv[2], verify=False, show_progress=False,"
            " overwrite=True)"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(hf), str(ckpt)], check=True, capture_output=True
        )
    return hf, ckpt


def main() -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per command (median shown)")
    p.add_argument("--workdir", type=Path, help="where the tiny model goes (default: a temp dir)")
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="porting-bench-cli-"))
    work.mkdir(parents=True, exist_ok=True)
    hostile = work / "hostile"
    hostile.mkdir(exist_ok=True)
    (hostile / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 0})
    )
    unknown = work / "unknown"
    unknown.mkdir(exist_ok=True)
    (unknown / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    hf, ckpt = _tiny_checkpoint(work)
    other = work / "other"  # the tiny Llama's files with one layer more: another model
    if not other.exists():
        shutil.copytree(hf, other)
        config = json.loads((other / "config.json").read_text())
        config["num_hidden_layers"] += 1
        (other / "config.json").write_text(json.dumps(config))
    cases = {
        "porting families": ["families"],
        "porting --help": ["--help"],
        "porting import --help": ["import", "--help"],
        "import: missing directory": ["import", str(work / "absent"), "--out", str(work / "o1")],
        "import: unknown architecture": ["import", str(unknown), "--out", str(work / "o2")],
        "import: hostile config value": ["import", str(hostile), "--out", str(work / "o3")],
        "import: output exists": ["import", str(hf), "--out", str(ckpt)],
        "verify: another model's files": ["verify", str(other), str(ckpt)],
        "verify (tiny Llama)": ["verify", str(hf), str(ckpt)],
    }
    print(f"{'command':<32}{'exit':>5}{'first line s':>14}{'wall s':>9}{'peak MB':>9}")
    for name, argv in cases.items():
        runs = [_run(argv) for _ in range(args.repeat)]
        wall = statistics.median(r[0] for r in runs)
        first = statistics.median(r[1] for r in runs)
        peak = _peak_mb(argv)
        print(f"{name:<32}{runs[0][2]:>5}{first:>14.2f}{wall:>9.2f}{peak:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
