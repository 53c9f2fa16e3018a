"""One conversion over several processes: the launching side and what a rank needs.

``porting import --executor torchrun --nproc-per-node N`` (or ``slurm``) claims the output as a
one-process import does (lock, staging directory beside it), then starts N ranks of the same
command through torchrun with the staging directory handed over in :data:`STAGING_ENV`
(:mod:`porting.handoff`: a shell that carries the variable makes no rank). Each rank joins one
process group (gloo on the CPU): NeMo's trainer runs data parallel over them, and Megatron's
fully-parallel save (``FullyParallelSaveStrategyWrapper``) gives each rank a balanced share of the
checkpoint's tensors to produce and write into the one ``torch_dist`` checkpoint (one
``.metadata``, every rank's ``__R_0.distcp``). The gate is a pipeline of the ranks
(:class:`porting.parity.streamed._Stage`). Rank 0 writes the layout files, prints the report and
leaves the verdict; the launcher moves the staging directory into place only when every rank
succeeded and rank 0's verdict is there, and otherwise removes it and names the rank that failed
first and why.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from porting import handoff
from porting.errors import PortingError
from porting.guard import Terminated

STAGING_ENV = "PORTING_RANKS_STAGING"
# Inside the staging directory, removed before it becomes the output.
RANKS_DIR = ".porting-ranks"


def add_launch_flags(p) -> None:
    """Flags that spread one conversion over several processes (docs/conversion.md)."""
    g = p.add_argument_group("several processes")
    g.add_argument(
        "--executor",
        choices=["local", "torchrun", "slurm"],
        default="local",
        help="local: this process; torchrun: --nproc-per-node ranks on this node (an import's "
        "ranks each write their share of the tensors into the one checkpoint, through "
        "Megatron's fully-parallel save; the gate runs as a pipeline of the ranks' layers); "
        "slurm: the same ranks on --nnodes nodes of a Slurm job, submitted and followed "
        "(Ctrl-C cancels it; the output and this directory must be on a file system every "
        "node sees). Default: local",
    )
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=2,
        metavar="N",
        help="ranks per node with --executor torchrun or slurm (default 2)",
    )
    g.add_argument(
        "--nnodes", type=int, default=2, metavar="N", help="nodes with --executor slurm (default 2)"
    )
    g.add_argument("--partition", help="--executor slurm: the partition (default: Slurm's)")
    g.add_argument(
        "--time",
        dest="time_limit",
        metavar="LIMIT",
        help="--executor slurm: the job's time limit, as sbatch takes it (default: the "
        "partition's)",
    )


def check_launch_flags(args) -> None:
    """Refuse, before anything starts, launch flags that cannot work."""
    from porting import slurm

    slurm.check_launch_size(
        args.nnodes if args.executor == "slurm" else 1, args.nproc_per_node,
        local=args.executor == "torchrun", nodes_flag="--nnodes", ranks_flag="--nproc-per-node",
    )  # fmt: skip
    if args.executor == "slurm":
        from porting import shell

        for flag, value in (("--partition", args.partition), ("--time", args.time_limit)):
            if value is not None:
                shell.checked(value, flag)
        # every value the job's script will hold (the inputs named first: a positional one has
        # no flag), and the directory its staging goes under
        for what, value in (("HF directory", getattr(args, "hf_dir", None)),
                            ("checkpoint", getattr(args, "ckpt", None))):  # fmt: skip
            if value is not None:
                shell.checked(str(value), what)
        shell.command(rank_argv(args.typed, args.command))
        if args.command == "verify":
            shell.checked(str(Path.cwd()), "the current directory (verify stages its report there)")
    if args.whole_model:
        raise PortingError("--whole-model is one process's gate; the ranks' gate is streamed")
    if args.device == "cuda":
        raise PortingError(
            f"--executor {args.executor} gates on the CPU; leave --device at auto or cpu"
        )
    if args.executor == "slurm":
        slurm.sbatch_path("--executor torchrun")


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


def described(args) -> str:
    """ "4 ranks on 2 nodes", "2 ranks"."""
    nodes = args.nnodes if args.executor == "slurm" else 1
    n = nodes * args.nproc_per_node
    return f"{n} rank{'s' if n > 1 else ''}" + (f" on {nodes} nodes" if nodes > 1 else "")


def launch(args, command: str, stage_dir: Path) -> tuple[str, bool]:
    """Run ``porting COMMAND`` (this one's arguments, launch flags dropped) as the ranks the
    flags ask for, writing into ``stage_dir``; return rank 0's report and its verdict."""
    argv = rank_argv(args.typed, command)
    if args.executor == "slurm":
        job = launch_slurm(
            command, argv, stage_dir, args.nnodes, args.nproc_per_node, args.partition,
            args.time_limit,
        )  # fmt: skip
        return report_of(stage_dir, job)
    launch_torchrun(command, argv, stage_dir, args.nproc_per_node)
    return report_of(stage_dir)


def staging() -> Path | None:
    """The staging directory this rank writes into, or None outside a launched conversion; an
    error naming :data:`STAGING_ENV` when a shell carried it without its launch."""
    state = handoff.received(STAGING_ENV)
    return None if state is None else Path(state["stage"])


def ranks_on_this_node() -> int:
    """How many ranks of this conversion share this node (1 outside a launched one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if staging() is not None else 1


def _handed(stage_dir: Path) -> dict[str, str]:
    """The environment that makes the launched processes ranks of this conversion."""
    where = stage_dir.absolute() / RANKS_DIR
    where.mkdir(exist_ok=True)
    return handoff.hand_off(STAGING_ENV, where, stage=str(stage_dir.absolute()))


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


def launch_torchrun(command: str, argv: list[str], stage_dir: Path, nproc: int) -> None:
    """Run ``porting COMMAND ARGV`` as ``nproc`` ranks on this node through torchrun, writing
    into ``stage_dir``; raise :class:`PortingError` naming the failing rank. Rank 0's output
    reaches this terminal; torchrun's own report goes to a log that the error quotes from.
    A stop of this process (Ctrl-C, SIGTERM) stops every rank before the staging is removed."""
    from porting.guard import die_with_parent

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "porting.cli", command, *argv,
    ]  # fmt: skip
    # A conversion's ranks compute on the host: each gets its share of this node's cores (torchrun
    # would give each one thread, with a banner saying so); a value the user set stands.
    cores = len(os.sched_getaffinity(0))
    threads = {"OMP_NUM_THREADS": str(max(1, cores // nproc))}
    # torchrun's own temporary directories (torchelastic_*) go with the staging directory
    tmp = stage_dir.absolute() / RANKS_DIR / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = threads | os.environ | _handed(stage_dir) | {"TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=die_with_parent,
    )  # fmt: skip
    said: list[str] = []
    reader = threading.Thread(target=_forward, args=(proc.stderr, said), daemon=True)
    reader.start()
    try:
        code = proc.wait()
    except BaseException:
        _stop(proc)
        raise
    finally:
        reader.join(timeout=10)
    if code != 0:
        raise failure(stage_dir, "".join(said), "torchrun " + shlex.join(cmd[4:6]))


# Where a failure's report begins on the ranks' stderr: a rank's own error line, a traceback,
# torch elastic's log lines. From there on the launcher's one summary speaks instead.
_FAILING = re.compile(
    r"porting \w+: error:|Traceback |\[rank\d+\]:|[WEI]\d{4} |\[[WE]\d{4}|ERROR:torch"
)


def _forward(stream, said: list[str]) -> None:
    """Pass the ranks' stderr (our own lines: warnings, the import's summary) to this terminal
    as it comes, until a failure's report begins; keep all of it for the error."""
    quiet = False
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        said.append(line)
        quiet = quiet or bool(_FAILING.match(line))
        if not quiet:
            sys.stderr.write(line)
            sys.stderr.flush()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's process group (torchrun passes it to the ranks), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def launch_slurm(
    command: str,
    argv: list[str],
    stage_dir: Path,
    nodes: int,
    nproc: int,
    partition: str | None,
    time_limit: str | None,
) -> str:
    """Submit ``porting COMMAND ARGV`` as a Slurm job of ``nodes`` x ``nproc`` torchrun ranks
    writing into ``stage_dir`` (which every node must see), follow it to its end, and raise
    :class:`PortingError` naming the failing rank, or how the job ended; return its id. Ctrl-C,
    SIGTERM or an error while following cancels the job (:func:`porting.slurm.follow`). The job
    is not requeued after a node failure: its ranks would start over into a half-written
    directory; the conversion fails, and a rerun starts afresh."""
    from porting import slurm

    where = stage_dir / RANKS_DIR
    where.mkdir(exist_ok=True)
    script = where / f"{command}.sbatch"
    (value,) = _handed(stage_dir).values()
    log_what = "--out" if command != "verify" else "the current directory"
    script.write_text(
        slurm.torchrun_script(
            f"porting-{command}", nodes, nproc, where, [command, *argv], log_what=log_what,
            partition=partition, time_limit=time_limit, switches=("no-requeue",),
            exports={STAGING_ENV: (value, log_what)}, share_cores=True,
        )
    )  # fmt: skip
    job = slurm.sbatch([str(script)], f"the {command}")
    log = where / f"job-{job}.out"
    each = f"{nproc} rank{'s' if nproc > 1 else ''} each"
    print(
        f"submitted Slurm job {job} ({nodes} nodes, {each}); log {log}", file=sys.stderr,
        flush=True,
    )  # fmt: skip
    tail = _Log(log)
    slurm.follow([job], lambda: _poll(job, tail, stage_dir), then="partial outputs removed")
    return job


def _poll(job: str, log: _Log, stage_dir: Path) -> bool:
    """One look at a conversion's job (its new log lines shown): True once it has completed; an
    error naming the failing rank, or how the job ended."""
    from porting import slurm

    log.show()
    tasks = slurm.tasks(job)
    state = tasks[0].get("JobState", "") if tasks else None
    if state == "COMPLETED":
        return True
    if state is None:
        if (stage_dir / RANKS_DIR / "verdict").exists():  # rank 0 got to its end
            return True
        raise slurm.JobEnded(
            f"Slurm no longer knows job {job}; its log ends:\n{slurm.tail(log.path)}"
        )
    if state in slurm.FAILED_STATES:
        text = log.show()
        if _root_cause(text) is not None or list((stage_dir / RANKS_DIR).glob("*.error")):
            raise slurm.JobEnded(str(failure(stage_dir, text, f"Slurm job {job}")))
        longer = "; give a longer --time" if state == "TIMEOUT" else ""
        raise slurm.JobEnded(
            f"Slurm job {job} ended {slurm.ended(tasks[0])}{longer}; nothing was written. "
            f"Its log ends:\n{slurm.tail(log.path)}"
        )
    return False


class _Log:
    """A job's log as it grows: its new whole lines passed to this terminal until a failure's
    report begins (as :func:`_forward` does for torchrun)."""

    def __init__(self, path: Path) -> None:
        self.path, self.shown, self.quiet = path, 0, False

    def show(self) -> str:
        """The log so far, its new lines shown."""
        try:
            text = self.path.read_bytes().decode(errors="replace")
        except FileNotFoundError:
            return ""
        cut = text.rfind("\n") + 1
        for line in text[self.shown : cut].splitlines(keepends=True):
            self.quiet = self.quiet or bool(_FAILING.match(line))
            if not self.quiet:
                sys.stderr.write(line)
        sys.stderr.flush()
        self.shown = max(self.shown, cut)
        return text
