"""Talking to Slurm for the commands that submit to it (``prep-data --executor slurm``, ``train
--executor slurm``): ``sbatch``, the state of a job's tasks from ``scontrol``, ``scancel``.

``scontrol`` rather than ``sacct``: a cluster without slurmdbd has no ``sacct``, and every cluster
keeps a finished job in ``scontrol`` for its ``MinJobAge`` (300 s by default); a caller judges a
job Slurm has forgotten by what it left behind.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from porting.errors import PortingError

log = logging.getLogger(__name__)

# The ceilings of a launch, the planner's own (MAX_GPUS and MAX_GPUS_PER_NODE of
# porting/planner/limits.py, held equal by a test): far above any real allocation, low enough
# that a typo is refused rather than started.
MAX_NODES = 262_144
MAX_RANKS_PER_NODE = 1024
# How long a follower waits out a controller that does not answer (a busy slurmctld says "Socket
# timed out" for seconds at a time, several times its MessageTimeout of 10 s by default) before
# it gives up and cancels the job.
PATIENCE_S = 60.0
# How long a cancel waits for the job's processes to stop (Slurm's KillWait is 30 s by default).
ENDING_S = 45.0

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
        raise PortingError(
            f"sbatch did not answer in 120 s submitting {what}; the job may have been queued all "
            "the same: look for it with squeue --me and cancel it (scancel ID)"
        ) from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
        raise PortingError(f"sbatch refused {what}: {said}")
    return done.stdout.strip().split(";")[0]


class Unreachable(PortingError):
    """``scontrol`` did not answer (or answered with an error): worth asking again."""


class JobEnded(PortingError):
    """A followed job ended without its verdict (failed, cancelled, timed out, forgotten): there
    is nothing left to cancel."""


def check_launch_size(
    nodes: int, ranks_per_node: int, *, local: bool, nodes_flag: str, ranks_flag: str
) -> None:
    """Refuse a launch no node can schedule: at least 1 of each, at most the planner's ceilings,
    and on this node (``local``) no more ranks than the cores this process may run on."""
    for flag, value, ceiling in ((nodes_flag, nodes, MAX_NODES),
                                 (ranks_flag, ranks_per_node, MAX_RANKS_PER_NODE)):  # fmt: skip
        if value < 1:
            raise PortingError(f"{flag} must be at least 1, not {value}")
        if value > ceiling:
            raise PortingError(f"{flag} {value} is more than the limit of {ceiling}")
    if local:
        cores = len(os.sched_getaffinity(0))
        if ranks_per_node > cores:
            raise PortingError(
                f"{ranks_flag} {ranks_per_node}: this node can run {cores} process(es) at once "
                f"(its cores); give at most {cores}, or --executor slurm for more nodes"
            )


def cancel(job_ids: list[str | None]) -> str:
    """``scancel`` these jobs (those that are already over are left as they are); what was done,
    for a message."""
    ids = [j for j in job_ids if j]
    if not ids:
        return ""
    named = f"Slurm job{'s' if len(ids) > 1 else ''} {', '.join(ids)}"
    if shutil.which("scancel") is None:
        return f"{named} could not be cancelled (scancel not on PATH): cancel {named} by hand"
    try:
        done = subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return f"{named}: scancel did not answer in 60 s; run scancel {' '.join(ids)} by hand"
    if done.returncode != 0 and "already completing or completed" not in done.stderr:
        said = done.stderr.strip() or f"exit {done.returncode}"
        return f"{named}: scancel failed ({said}); run scancel {' '.join(ids)} by hand"
    # scancel only signals: the caller removes what the ranks write into once they have stopped
    deadline = time.monotonic() + ENDING_S
    while time.monotonic() < deadline:
        try:
            if not any(_still_running(tasks(j)) for j in ids):
                return f"{named} cancelled"
        except PortingError:  # Slurm does not answer: nothing more to learn here
            return f"{named} cancelled (Slurm did not say whether it has ended: check squeue)"
        time.sleep(0.5)
    return f"{named} cancelled (still ending after {ENDING_S:.0f} s: check squeue)"


def _still_running(job_tasks: list[dict] | None) -> bool:
    return bool(job_tasks) and any(t.get("JobState") in _ACTIVE for t in job_tasks)


# States in which a job's processes may still be writing (squeue --help).
_ACTIVE = frozenset({
    "CONFIGURING", "COMPLETING", "RESIZING", "RUNNING", "SIGNALING", "STAGE_OUT", "STOPPED",
    "SUSPENDED",
})  # fmt: skip


def follow(
    job_ids: list[str | None],
    poll: Callable[[], bool],
    *,
    poll_s: float = 1.0,
    patience_s: float | None = None,
    then: str | None = None,
) -> None:
    """Call ``poll()`` until it says the jobs are done (their verdict checked by it).

    A Slurm that does not answer (:class:`Unreachable`) is asked again, less often, for up to
    ``patience_s`` (default :data:`PATIENCE_S`). Every other way out but :class:`JobEnded` (an
    error, Slurm unreachable for longer, Ctrl-C, SIGTERM) cancels the jobs first and says so: a
    job left behind would run later against a directory that is gone, while a rerun may hold the
    output. A stop's closing line says what was cancelled, then ``then`` (what remains, what to
    do).
    """
    from porting.guard import Terminated

    patience_s = PATIENCE_S if patience_s is None else patience_s
    failing_since = None
    wait = poll_s
    try:
        while True:
            try:
                if poll():
                    return
                failing_since, wait = None, poll_s
            except Unreachable as err:
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("%s; asking again for up to %.0f s", err, patience_s)
                elif now - failing_since >= patience_s:
                    raise PortingError(
                        f"{err}; Slurm did not answer for {now - failing_since:.0f} s"
                    ) from err
                wait = min(max(wait * 2, poll_s), 15.0, max(patience_s / 4, poll_s))
            time.sleep(wait)
    except JobEnded:
        raise
    except (KeyboardInterrupt, Terminated) as stop:
        said = cancel(job_ids)
        stop.kept = f"{said}; {then}" if then else said
        raise
    except PortingError as err:
        raise PortingError(f"{err}\n{cancel(job_ids)}") from err
    except BaseException:
        log.error("%s", cancel(job_ids))
        raise


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
    except subprocess.TimeoutExpired:
        raise Unreachable(f"scontrol show job {job_id} did not answer in 60 s") from None
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        said = done.stderr.strip() or f"exit {done.returncode}"
        raise Unreachable(f"scontrol show job {job_id}: {said}")
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in done.stdout.splitlines() if line]


class JobLog:
    """A followed job's log as it grows: each poll passes its new whole lines to this terminal
    (``stream``: ``"stdout"`` or ``"stderr"``), until a line ``quiet_from`` matches (where a
    failure's report begins: the follower's one error speaks instead). A log that shrank was
    started afresh (a requeued job's script runs again) and is shown again from its start."""

    def __init__(self, path: Path, stream: str = "stderr", quiet_from: re.Pattern | None = None):
        self.path, self.stream, self.quiet_from = path, stream, quiet_from
        self.shown, self.quiet = 0, False

    def show(self) -> None:
        """Pass on the lines written since the last call."""
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.shown:
                    self.shown = 0
                fh.seek(self.shown)
                new = fh.read()
        except FileNotFoundError:
            return
        cut = new.rfind(b"\n") + 1  # whole lines only
        if not cut:
            return
        out = getattr(sys, self.stream)
        for line in new[:cut].decode(errors="replace").splitlines(keepends=True):
            if self.quiet_from is not None:
                self.quiet = self.quiet or bool(self.quiet_from.match(line))
            if not self.quiet:
                out.write(line)
        out.flush()
        self.shown += cut

    def text(self) -> str:
        """The whole log so far (empty before the job writes it)."""
        try:
            return self.path.read_bytes().decode(errors="replace")
        except FileNotFoundError:
            return ""


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


# What srun runs on each node: the command under a TMPDIR of its own (torchrun's torchelastic_*
# directories), removed when it ends, stopped included (Slurm signals every process of the step).
PRIVATE_TMPDIR = (
    'tmp=$(mktemp -d "${TMPDIR:-/tmp}/porting-ranks.XXXXXX"); '
    "trap 'rm -rf \"$tmp\"' EXIT; trap 'exit 143' TERM INT HUP; "
    'TMPDIR="$tmp" "$@"'
)


def torchrun_script(
    job_name: str,
    nodes: int,
    nproc_per_node: int,
    log_dir: Path,
    argv: list,
    *,
    log_what: str = "--out",
    gpus_per_node: int | None = None,
    partition: str | None = None,
    time_limit: str | None = None,
    switches: tuple[str, ...] = (),
    exports: dict[str, tuple[str, str]] | None = None,
    share_cores: bool = False,
) -> str:
    """A batch script that runs ``porting ARGV`` as torchrun ranks on every node of the
    allocation, the job's log in ``log_dir/job-ID.out``. Every value goes through
    :mod:`porting.shell`: ``argv`` as words (a value named by its flag in an error), ``partition``
    and ``time_limit`` as directives, ``exports`` (``NAME: (value, flag)``) as ``export`` lines,
    ``log_dir`` as sbatch's ``--output`` (named ``log_what`` in an error).

    The rendezvous is the first node's ``NodeAddr`` (a node's name need not resolve as a host
    name) and a port drawn from the job id (two jobs on one node do not meet); torchrun is this
    environment's, run by its Python, under a private ``TMPDIR`` on each node
    (:data:`PRIVATE_TMPDIR`). ``share_cores`` gives each rank its share of the node's cores unless
    the job's environment sets ``OMP_NUM_THREADS``.
    """
    import sys

    from porting import shell

    head = [
        shell.directive("job-name", job_name),
        shell.directive("nodes", nodes),
        shell.directive("ntasks-per-node", 1),
        "#SBATCH --exclusive",
        shell.directive("output", shell.log_pattern(log_dir, "job-%j.out", log_what), log_what),
    ]
    head += [shell.directive(flag, value) for flag, value in (
        ("partition", partition), ("time", time_limit)) if value]  # fmt: skip
    if gpus_per_node is not None:
        head.append(shell.directive("gpus-per-node", gpus_per_node))
    head += [f"#SBATCH --{switch}" for switch in switches]
    env = [shell.export(k, value, what) for k, (value, what) in (exports or {}).items()]
    if share_cores:
        env.append(
            f"cores=$(nproc); export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-$(( cores / "
            f"{int(nproc_per_node)} > 0 ? cores / {int(nproc_per_node)} : 1 ))}}"
        )
    python = shell.word(sys.executable, "this Python's path")
    lines = "\n".join([*head, ""])
    return f"""#!/bin/bash
{lines}set -euo pipefail
# no pipe into head: under pipefail, scontrol writing on after head exits would end the job
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
first=${{hosts%%$'\\n'*}}
export MASTER_ADDR=$(scontrol show node "$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
export MASTER_PORT=${{MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}}
# The first node's agent hosts the rendezvous and may leave before the others close it; they then
# warn ("failed to shutdown the rendezvous", TCPStore's "recvVector failed") after a job that
# succeeded. Errors still print; a job's environment may ask for more. (torch.distributed's
# Python loggers answer TORCH_LOGS, not LOGLEVEL: "-distributed" is their ERROR level.)
export TORCH_LOGS=${{TORCH_LOGS:--distributed}} TORCH_CPP_LOG_LEVEL=${{TORCH_CPP_LOG_LEVEL:-ERROR}}
{"".join(line + chr(10) for line in env)}srun bash -c {shell.word(PRIVATE_TMPDIR, "-")} porting-rank \\
  {python} -m torch.distributed.run \\
  --nnodes={int(nodes)} --nproc-per-node={int(nproc_per_node)} \\
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
  -m porting.cli {shell.command(argv)}
"""
