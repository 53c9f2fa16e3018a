"""One conversion over several processes: what a rank needs, and what it leaves its launcher
(:mod:`porting.convert.executors` starts the ranks and reads it).

``porting import --executor torchrun --nproc-per-node N`` (or ``slurm``) claims the output as a
one-process import does (lock, staging directory beside it), then starts N ranks of the same
command through torchrun with the staging directory handed over in :data:`STAGING_ENV`
(:mod:`porting.handoff`: a shell that carries the variable makes no rank). Each rank joins one
process group (gloo on the CPU): NeMo's trainer runs data parallel over them, and Megatron's
fully-parallel save (``FullyParallelSaveStrategyWrapper``) gives each rank a balanced share of the
checkpoint's tensors to produce and write into the one ``torch_dist`` checkpoint (one
``.metadata``, every rank's ``__R_0.distcp``). The gate is a pipeline of the ranks
(:class:`porting.parity.sides.Stage`). Rank 0 writes the layout files, prints the report and
leaves the verdict; the launcher moves the staging directory into place only when every rank
succeeded and rank 0's verdict is there, and otherwise removes it and names the rank that failed
first and why.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path

from porting import handoff
from porting.errors import PortingError
from porting.guard import Terminated

STAGING_ENV = "PORTING_RANKS_STAGING"
# Inside the staging directory, removed before it becomes the output.
RANKS_DIR = ".porting-ranks"


def refuse_hand_launched(command: str) -> None:
    """A conversion started as ranks by someone else's launcher would run one whole conversion
    per rank, racing for the output: the ranks are ours to start. A stray ``RANK`` in one
    process would make it a rank that writes no manifest."""
    if staging() is not None:
        return
    if world_size() > 1:
        raise PortingError(
            f"porting {command} runs as {world_size()} ranks of a launcher it did not start; "
            f"give --executor torchrun (this node) or --executor slurm instead"
        )
    if os.environ.get("RANK", "0") not in ("", "0"):
        raise PortingError(
            f"RANK={os.environ['RANK']} is set in this environment, but porting {command} runs "
            "as one process here: unset RANK (the ranks of a conversion are porting's to start: "
            "--executor torchrun or slurm)"
        )


def staging() -> Path | None:
    """The staging directory this rank writes into, or None outside a launched conversion; an
    error naming :data:`STAGING_ENV` when a shell carried it without its launch."""
    state = handoff.received(STAGING_ENV)
    return None if state is None else Path(state["stage"])


def ranks_on_this_node() -> int:
    """How many ranks of this conversion share this node (1 outside a launched one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if staging() is not None else 1


def rank() -> int:
    """This rank of a launched conversion (0 in one process, whatever a shell carries)."""
    return int(os.environ.get("RANK", "0")) if staging() is not None else 0


def world_size() -> int:
    """The ranks of the launcher that started this process (torchrun's ``WORLD_SIZE``)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise PortingError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in this environment is not a number"
        ) from None


def rank_argv(argv: list[str], command: str) -> list[str]:
    """The arguments of ``porting COMMAND ...`` (as typed: ``args.typed``) with the launch flags
    dropped (what a rank runs). Exact, as no parser of ours takes an abbreviated flag."""
    argv = argv[argv.index(command) + 1 :]
    out, skip = [], False
    launch = {"--executor", "--nproc-per-node", "--nnodes", "--partition", "--time"}
    for a in argv:
        if skip:
            skip = False
        elif a in launch:
            skip = True
        elif a.split("=", 1)[0] in launch or a in ("--no-submit", "--cpu-nodes"):
            continue
        else:
            out.append(a)
    return out


def record_failure(err: BaseException) -> None:
    """Leave this rank's reason for the launcher (one line for our errors, the last frames
    otherwise); a rank killed outright leaves none, and torchrun's record says so."""
    try:
        root = staging()
    except PortingError:  # a stray variable, refused: no launch to tell
        return
    if root is None:
        return
    if isinstance(err, PortingError):
        text = str(err)
    elif isinstance(err, (KeyboardInterrupt, SystemExit, Terminated)):
        return  # a stop: the launcher stopped the ranks and says so
    else:
        text = "".join(traceback.format_exception(err, limit=-3)).rstrip()
    where = root / RANKS_DIR
    path = where / f"rank-{rank()}.error"
    tmp = path.with_suffix(".tmp")
    try:
        where.mkdir(exist_ok=True)
        tmp.write_text(text + "\n")
        tmp.replace(path)
    except OSError:  # the launcher removed the staging already: it knows
        pass


def leave_report(text: str, passed: bool = True) -> None:
    """Rank 0's report and verdict, printed by the launcher once the ranks are done."""
    where = staging() / RANKS_DIR
    where.mkdir(exist_ok=True)
    (where / "report.out").write_text(text)
    (where / "verdict").write_text("passed\n" if passed else "failed\n")


def report_of(stage_dir: Path, job: str | None = None) -> tuple[str, bool]:
    """The report rank 0 left (empty without the gate) and its verdict; the launch's files
    removed: what remains of the staging directory is the output. Ranks that all ended well
    but left no verdict did not finish this conversion where the launcher looks (a Slurm job
    whose output was on a node-local path): that is refused, never taken for a success."""
    import shutil

    where = stage_dir / RANKS_DIR
    try:
        verdict = (where / "verdict").read_text()
        said = (where / "report.out").read_text()
    except OSError:
        ran = f"Slurm job {job} completed" if job else "the ranks exited 0"
        raise PortingError(
            f"{ran} but rank 0 left no report in {where}: nothing is taken as written. The "
            "output (and the directory the command runs in) must be on a file system that "
            "every node sees, not a node-local path"
        ) from None
    if verdict not in ("passed\n", "failed\n"):
        raise PortingError(f"{where / 'verdict'}: not a verdict ({verdict[:40]!r})")
    shutil.rmtree(where, ignore_errors=True)
    return said, verdict == "passed\n"


def _root_cause(log: str) -> tuple[int, str] | None:
    """(rank, what happened) of torchrun's "Root Cause (first observed failure)" record."""
    block = log.split("Root Cause (first observed failure)", 1)
    if len(block) < 2:
        return None
    found = re.search(r"rank\s*:\s*(\d+)", block[1])
    if found is None:
        return None
    code = re.search(r"exitcode\s*:\s*(-?\d+)", block[1])
    signal_line = re.search(r"Signal (\d+) \((\w+)\) received", block[1])
    if signal_line:
        how = f"was killed by signal {signal_line.group(1)} ({signal_line.group(2)})"
    elif code and int(code.group(1)) < 0:
        how = f"was killed by signal {-int(code.group(1))}"
    else:
        how = f"exited with status {code.group(1) if code else '?'}"
    return int(found.group(1)), how


def failure(stage_dir: Path, log: str, launcher: str) -> PortingError:
    """The error a failed multi-process conversion raises: the rank that failed first and why."""
    cause = _root_cause(log)
    errors = (
        sorted((stage_dir / RANKS_DIR).glob("rank-*.error"), key=lambda p: p.stat().st_mtime_ns)
        if (stage_dir / RANKS_DIR).is_dir()
        else []
    )
    if cause is not None:
        first, how = cause
        own = stage_dir / RANKS_DIR / f"rank-{first}.error"
        if own.exists():
            return PortingError(f"rank {first} failed: {own.read_text().strip()}")
        # A rank killed outright left no reason; the others then fail on the broken group.
        return PortingError(f"rank {first} {how}; the conversion was stopped on every rank")
    if errors:
        first = errors[0].name.removeprefix("rank-").removesuffix(".error")
        return PortingError(f"rank {first} failed: {errors[0].read_text().strip()}")
    tail = "\n".join(log.strip().splitlines()[-8:])
    return PortingError(f"{launcher} failed before any rank reported:\n{tail}")
