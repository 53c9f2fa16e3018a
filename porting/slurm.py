"""Talking to Slurm for the commands that submit to it (``prep-data --executor slurm``, ``train
--executor slurm``): ``sbatch``, the state of a job's tasks from ``scontrol``, ``scancel``.

``scontrol`` rather than ``sacct``: a cluster without slurmdbd has no ``sacct``, and every cluster
keeps a finished job in ``scontrol`` for its ``MinJobAge`` (300 s by default); a caller judges a
job Slurm has forgotten by what it left behind.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from porting.errors import PortingError

# States after which a task will not run again (``squeue --help``); a REQUEUED one does.
FAILED_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT",
})  # fmt: skip


def sbatch_path(no_submit_flag: str = "--no-submit") -> str:
    """``sbatch``, or an error saying what to do without it."""
    found = shutil.which("sbatch")
    if found is None:
        raise PortingError(
            "sbatch not found on PATH (run on a Slurm login node, or add "
            f"{no_submit_flag} to write the scripts only)"
        )
    return found


def sbatch(argv: list[str], what: str) -> str:
    """Submit with ``sbatch --parsable ARGV``; the job id, or an error quoting sbatch."""
    try:
        done = subprocess.run(
            [sbatch_path(), "--parsable", *argv], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        raise PortingError(f"sbatch did not answer in 120 s submitting {what}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
        raise PortingError(f"sbatch refused {what}: {said}")
    return done.stdout.strip().split(";")[0]


def cancel(job_ids: list[str | None]) -> None:
    """``scancel`` these jobs (those that are already over are left as they are)."""
    ids = [j for j in job_ids if j]
    if ids and shutil.which("scancel"):
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60)


def tasks(job_id: str | None) -> list[dict] | None:
    """Each task of a job as ``scontrol -o show job`` gives it (``JobState``, ``ArrayTaskId``,
    ``NodeList``, ``ExitCode``, ``Reason``...); None: Slurm no longer knows the job."""
    if not job_id:
        return []
    try:
        done = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        raise PortingError(
            "scontrol not found on PATH: Slurm's client commands are needed to follow the job"
        ) from None
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise PortingError(f"scontrol show job {job_id}: {done.stderr.strip()}")
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in done.stdout.splitlines() if line]


def tail(path: Path, lines: int = 12) -> str:
    """The last lines of a job's log, indented, for an error message."""
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return f"    (no log at {path})"
    return "\n".join("    " + line for line in text[-lines:])


def ended(task: dict) -> str:
    """How a task ended, for a message: ``FAILED on node2 (exit 1:0)``."""
    reason = task.get("Reason")
    return (
        f"{task.get('JobState', '?')} on {task.get('NodeList', '?')} (exit "
        f"{task.get('ExitCode', '?')}{', ' + reason if reason not in (None, 'None') else ''})"
    )
