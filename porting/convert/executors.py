"""Where ``import``, ``export`` and ``verify`` run (``--executor``): this process, torchrun ranks
on this node, or the same ranks on the nodes of a Slurm job (:mod:`porting.launch`'s interface).
The launching side: the flags and their checks, the ranks started with the staging directory
handed over, their stderr or the job's log followed, rank 0's report read back. How the ranks
share the work, and what each leaves here: :mod:`porting.convert.ranks`."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from porting import handoff, launch
from porting.convert import ranks
from porting.errors import PortingError


class ConversionExecutor(launch.Executor):
    """Where one conversion runs."""

    def launch(self, command: str, argv: list[str], stage_dir: Path, args) -> str | None:
        """Run ``porting COMMAND ARGV`` as this executor's ranks, writing into ``stage_dir``;
        the scheduler's job id, if there is one. An error names the rank that failed first."""
        raise NotImplementedError(f"--executor {self.name} starts no ranks")


class Local(ConversionExecutor):
    name = "local"
    help = "this process"


class Torchrun(ConversionExecutor):
    name = "torchrun"
    help = (
        "--nproc-per-node ranks on this node (an import's ranks each write their share of the "
        "tensors into the one checkpoint, through Megatron's fully-parallel save; the gate runs "
        "as a pipeline of the ranks' layers)"
    )
    starts_ranks = True

    def launch(self, command: str, argv: list[str], stage_dir: Path, args) -> str | None:
        launch_torchrun(command, argv, stage_dir, args.nproc_per_node)
        return None


class Slurm(launch.Scheduled, ConversionExecutor):
    name = "slurm"
    help = (
        "the same ranks on --nnodes nodes of a Slurm job, submitted and followed (Ctrl-C cancels "
        "it; the output and this directory must be on a file system every node sees)"
    )

    def launch(self, command: str, argv: list[str], stage_dir: Path, args) -> str | None:
        return launch_slurm(
            command, argv, stage_dir, args.nnodes, args.nproc_per_node, args.partition,
            args.time_limit,
        )  # fmt: skip


#: Every executor of a conversion by its ``--executor`` name, in the order ``--help`` lists them.
EXECUTORS: launch.Executors[ConversionExecutor] = launch.Executors(Local(), Torchrun(), Slurm())


# Where a failure's report begins on the ranks' stderr: a rank's own error line, a traceback,
# torch elastic's log lines. From there on the launcher's one summary speaks instead.
_FAILING = re.compile(
    r"porting \w+: error:|Traceback |\[rank\d+\]:|[WEI]\d{4} |\[[WE]\d{4}|ERROR:torch"
)


def add_launch_flags(p) -> None:
    """Flags that spread one conversion over several processes (docs/conversion.md)."""
    g = p.add_argument_group("several processes")
    EXECUTORS.add_to(g, help_default=True)
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


def executor(args) -> ConversionExecutor:
    """The executor ``--executor`` picks."""
    return EXECUTORS.get(args.executor)


def check_launch_flags(args) -> None:
    """Refuse, before anything starts, launch flags that cannot work."""
    executor = EXECUTORS.get(args.executor)
    executor.check_size(
        executor.nodes(args.nnodes), args.nproc_per_node, nodes_flag="--nnodes",
        ranks_flag="--nproc-per-node",
    )  # fmt: skip
    executor.check_script_values([("--partition", args.partition), ("--time", args.time_limit)])
    if executor.spans_nodes:
        from porting import shell

        # every value the job's script will hold (the inputs named first: a positional one has
        # no flag), and the directory its staging goes under
        for what, value in (("HF directory", getattr(args, "hf_dir", None)),
                            ("checkpoint", getattr(args, "ckpt", None))):  # fmt: skip
            if value is not None:
                shell.checked(str(value), what)
        shell.command(ranks.rank_argv(args.typed, args.command))
        if args.command == "verify":
            shell.checked(str(Path.cwd()), "the current directory (verify stages its report there)")
    if args.whole_model:
        raise PortingError("--whole-model is one process's gate; the ranks' gate is streamed")
    if args.device == "cuda":
        raise PortingError(
            f"--executor {args.executor} gates on the CPU; leave --device at auto or cpu"
        )
    executor.check_submit("--executor torchrun")


def described(args) -> str:
    """ "4 ranks on 2 nodes", "2 ranks"."""
    nodes = EXECUTORS.get(args.executor).nodes(args.nnodes)
    n = nodes * args.nproc_per_node
    return f"{n} rank{'s' if n > 1 else ''}" + (f" on {nodes} nodes" if nodes > 1 else "")


def launch(args, command: str, stage_dir: Path) -> tuple[str, bool]:
    """Run ``porting COMMAND`` (this one's arguments, launch flags dropped) as the ranks the
    flags ask for, writing into ``stage_dir``; return rank 0's report and its verdict."""
    job = EXECUTORS.get(args.executor).launch(
        command, ranks.rank_argv(args.typed, command), stage_dir, args
    )
    return ranks.report_of(stage_dir, job)


def _handed(stage_dir: Path) -> dict[str, str]:
    """The environment that makes the launched processes ranks of this conversion."""
    where = stage_dir.absolute() / ranks.RANKS_DIR
    where.mkdir(exist_ok=True)
    return handoff.hand_off(ranks.STAGING_ENV, where, stage=str(stage_dir.absolute()))


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
    tmp = stage_dir.absolute() / ranks.RANKS_DIR / "tmp"
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
        raise ranks.failure(stage_dir, "".join(said), "torchrun " + shlex.join(cmd[4:6]))


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

    where = stage_dir / ranks.RANKS_DIR
    where.mkdir(exist_ok=True)
    script = where / f"{command}.sbatch"
    (value,) = _handed(stage_dir).values()
    log_what = "--out" if command != "verify" else "the current directory"
    script.write_text(
        slurm.torchrun_script(
            f"porting-{command}", nodes, nproc, where, [command, *argv], log_what=log_what,
            partition=partition, time_limit=time_limit, switches=("no-requeue",),
            exports={ranks.STAGING_ENV: (value, log_what)}, share_cores=True,
        )
    )  # fmt: skip
    job = slurm.sbatch([str(script)], f"the {command}")
    log = where / f"job-{job}.out"
    each = f"{nproc} rank{'s' if nproc > 1 else ''} each"
    print(
        f"submitted Slurm job {job} ({nodes} nodes, {each}); log {log}", file=sys.stderr,
        flush=True,
    )  # fmt: skip
    tail = slurm.JobLog(log, quiet_from=_FAILING)
    slurm.follow([job], lambda: _poll(job, tail, stage_dir), then="partial outputs removed")
    return job


def _poll(job: str, log, stage_dir: Path) -> bool:
    """One look at a conversion's job (its new log lines shown): True once it has completed; an
    error naming the failing rank, or how the job ended."""
    from porting import slurm

    log.show()
    tasks = slurm.tasks(job)
    state = tasks[0].get("JobState", "") if tasks else None
    if state == "COMPLETED":
        return True
    if state is None:
        if (stage_dir / ranks.RANKS_DIR / "verdict").exists():  # rank 0 got to its end
            return True
        raise slurm.JobEnded(
            f"Slurm no longer knows job {job}; its log ends:\n{slurm.tail(log.path)}"
        )
    if state in slurm.FAILED_STATES:
        log.show()
        text = log.text()
        if ranks._root_cause(text) is not None or list(
            (stage_dir / ranks.RANKS_DIR).glob("*.error")
        ):
            raise slurm.JobEnded(str(ranks.failure(stage_dir, text, f"Slurm job {job}")))
        longer = "; give a longer --time" if state == "TIMEOUT" else ""
        raise slurm.JobEnded(
            f"Slurm job {job} ended {slurm.ended(tasks[0])}{longer}; nothing was written. "
            f"Its log ends:\n{slurm.tail(log.path)}"
        )
    return False
