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


def torchrun_script(
    job_name: str,
    nodes: int,
    nproc_per_node: int,
    log_dir: Path,
    command: str,
    *,
    gpus_per_node: int | None = None,
    partition: str | None = None,
    time_limit: str | None = None,
    sbatch_lines: tuple[str, ...] = (),
    exports: dict[str, str] | None = None,
    shell_lines: tuple[str, ...] = (),
) -> str:
    """A batch script that runs ``porting COMMAND`` (already quoted) as torchrun ranks on every
    node of the allocation, the job's log in ``log_dir/job-ID.out``.

    The rendezvous is the first node's ``NodeAddr`` (a node's name need not resolve as a host
    name) and a port drawn from the job id (two jobs on one node do not meet); torchrun is this
    environment's, run by its Python.
    """
    import shlex
    import sys

    lines = [f"#SBATCH --{flag}={shlex.quote(value)}" for flag, value in (
        ("partition", partition), ("time", time_limit)) if value]  # fmt: skip
    if gpus_per_node is not None:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    head = "".join(f"{line}\n" for line in (*lines, *sbatch_lines))
    env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (exports or {}).items())
    env += "".join(f"{line}\n" for line in shell_lines)
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output={shlex.quote(str(Path(log_dir).absolute()))}/job-%j.out
{head}set -euo pipefail
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$(scontrol show node "$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
export MASTER_PORT=${{MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}}
{env}srun {shlex.quote(sys.executable)} -m torch.distributed.run \\
  --nnodes={nodes} --nproc-per-node={nproc_per_node} \\
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
  -m porting.cli {command}
"""
