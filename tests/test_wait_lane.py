"""The waiting lane (tests/conftest.py, ``PORTING_WAIT_LANE=1`` as scripts/env.sh test sets it):
under pytest-xdist's ``--dist loadfile`` the highest-numbered worker runs every file named in
``WAITING`` and nothing else, and the other workers every other file. A real xdist run of a
small tree of test files that record which worker ran them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tree: Path, workers: int, *files: str) -> dict[str, set[str]]:
    """``{file: the workers that ran its cases}`` after an xdist run of ``files`` in ``tree``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PORTING_WAIT_LANE"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
         "--dist", "loadfile", *files],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran: dict[str, set[str]] = {}
    for line in (tree / "ran").read_text().splitlines():
        name, worker = line.split()
        ran.setdefault(name, set()).add(worker)
    return ran


@pytest.fixture
def tree(tmp_path) -> Path:
    """The suite's conftest beside four files of three cases each, one of them a WAITING file."""
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    body = (
        "import os\n"
        "def _ran(name):\n"
        "    with open(os.path.join(os.path.dirname(__file__), 'ran'), 'a') as fh:\n"
        "        fh.write(f\"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n\")\n"
    )
    for name in ("test_slurm.py", "test_a.py", "test_b.py", "test_c.py"):
        cases = "".join(f"def test_{i}():\n    _ran({name!r})\n" for i in range(3))
        (tmp_path / name).write_text(body + cases)
    return tmp_path


def test_the_last_worker_runs_only_the_waiting_files_and_the_others_never_do(tree):
    ran = _run(tree, 3)
    assert ran["test_slurm.py"] == {"gw2"}
    assert all(len(ran[f]) == 1 and "gw2" not in ran[f] for f in ("test_a.py", "test_b.py",
                                                                   "test_c.py"))  # fmt: skip


def test_a_run_with_no_waiting_file_or_only_one_still_runs_everything(tree):
    assert set(_run(tree, 3, "test_a.py", "test_b.py")) == {"test_a.py", "test_b.py"}
    (tree / "ran").unlink()
    assert _run(tree, 3, "test_slurm.py") == {"test_slurm.py": {"gw2"}}
