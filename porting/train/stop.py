"""A training run that is stopped leaves a run directory to resume from, and no process behind.

- :func:`~porting.guard.die_with_parent` (named here too, for the ranks): the kernel SIGKILLs
  this process when its parent dies. torchrun starts each rank in a session of its own and a
  rank's own children (a checkpoint writer, a data loader worker) are forked; the death signal
  is not inherited across ``fork``, so :func:`guard_forked_children` asks for it again in every
  child a rank forks, and gives it the default signal dispositions (a forked writer that raised
  our ``Terminated`` would print a traceback and keep the futex it waited on).
- :func:`run_settled` (a process of the run) and :func:`launched` (a launcher of ranks: torchrun,
  NeMo-Run): a stop, or a full disk, stops what the process started and settles the run
  directory; one line says what is kept.
- :func:`settle_checkpoints`: after a stop, the checkpoints whose save did not complete (NeMo's
  ``-unfinished`` marker) are removed, and ``checkpoints/last`` points at the newest complete
  ``*-last`` one; returns the line that says so.
- :func:`private_tmpdir`: torchrun's temporary directories (``torchelastic_*``) go under the run
  directory, removed when the launcher ends and, after a SIGKILL, by the next run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from porting import guard, handoff
from porting.guard import die_with_parent

# the process that started the ranks (its pid and start time), handed over by porting.handoff
LAUNCHER_ENV = "PORTING_TRAIN_LAUNCHER"
UNFINISHED = "-unfinished"  # NeMo's ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX
BRIDGE_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-Bridge's, written after a save
TMP_PREFIX = ".tmp-launcher-"


def _in_forked_child() -> None:
    die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_DFL)


_GUARDED = False


def launcher() -> dict | None:
    """The ``porting train`` process that started this rank (``pid``, ``created``), None when
    no launcher of ours did; an error naming :data:`LAUNCHER_ENV` when a shell carried it here
    without its launch (:mod:`porting.handoff`)."""
    return handoff.received(LAUNCHER_ENV)


def watch_launcher() -> None:
    """In a rank: end this process (and its launcher, torchrun) once the `porting train` process
    that started them is gone, SIGKILL included. NeMo-Run starts torchrun in a session of its own
    without a death signal, so the kernel would not end it; a thread polls instead."""
    import threading
    import time

    import psutil

    started_by = launcher()
    if started_by is None:
        return
    pid, created = started_by["pid"], started_by["created"]

    def alive() -> bool:
        try:
            return abs(psutil.Process(int(pid)).create_time() - float(created)) < 1e-3
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            time.sleep(0.5)
        with contextlib.suppress(OSError):
            os.kill(os.getppid(), signal.SIGKILL)
        os._exit(137)

    threading.Thread(target=watch, name="porting-launcher-watch", daemon=True).start()


def guard_forked_children() -> None:
    """From now on, every process this one forks dies with it and ends quietly on a signal."""
    global _GUARDED
    if not _GUARDED:
        os.register_at_fork(after_in_child=_in_forked_child)
        _GUARDED = True


def settle_checkpoints(out: str | os.PathLike) -> str:
    """Remove the unfinished checkpoints of run directory ``out`` and point ``checkpoints/last``
    at the newest complete one; return a line naming it (or saying there is none)."""
    ckpts = Path(out) / "checkpoints"
    if (ckpts / BRIDGE_TRACKER).exists() or any(ckpts.glob("iter_*")):
        return _settle_bridge(ckpts)
    from porting.train.recipe import link_last

    removed = []
    for marker in sorted(ckpts.glob(f"*{UNFINISHED}")):
        ckpt = marker.with_name(marker.name.removesuffix(UNFINISHED))
        if ckpt.is_dir() and not ckpt.is_symlink():
            shutil.rmtree(ckpt, ignore_errors=True)
        marker.unlink(missing_ok=True)
        removed.append(ckpt.name)
    last = link_last(out) if ckpts.is_dir() else None
    gone = f" (removed unfinished {', '.join(removed)})" if removed else ""
    if last is None:
        return f"no checkpoint was complete{gone}"
    return f"last complete checkpoint {last} -> {os.readlink(last)}{gone}"


def _settle_bridge(ckpts: Path) -> str:
    """:func:`settle_checkpoints` for a Megatron-Bridge run (``--engine bridge``): its tracker
    file is written once a save has finished, so an iteration past it is unfinished."""
    from porting.train.checks import bridge_iteration

    done = bridge_iteration(ckpts)
    if done is not None and (done / "train_state.pt").is_file():
        # Bridge resumes from what latest_train_state.pt names, written just before the tracker
        # file: a stop between the two would resume from a save the tracker does not vouch for.
        shutil.copyfile(done / "train_state.pt", ckpts / "latest_train_state.pt")
    removed = []
    for it in sorted(ckpts.glob("iter_*")):
        if it.is_dir() and not it.is_symlink() and (done is None or it.name > done.name):
            shutil.rmtree(it, ignore_errors=True)
            removed.append(it.name)
    gone = f" (removed unfinished {', '.join(removed)})" if removed else ""
    if done is None:
        return f"no checkpoint was complete{gone}"
    return f"last complete checkpoint {ckpts} -> {done.name}{gone}"


def run_settled(train: Callable[[], Path], out: Path, quiet_rank: bool) -> Path:
    """Run ``train()`` (one process of a run: the local one, or a rank); return what it returns.

    SIGINT raises ``Terminated`` here too (Lightning turns ``KeyboardInterrupt`` into
    ``exit(1)``). On a stop, or on a full disk, the processes this one started are stopped and,
    on the first rank, the run directory is settled; the exception then carries the line that
    says what is kept. A rank whose launcher does that (``quiet_rank``) stops without a word.
    """
    before = guard.child_pids()
    first = os.environ.get("RANK", "0") == "0"
    try:
        with guard.interrupts_as_terminated():
            return train()
    except (KeyboardInterrupt, guard.Terminated) as err:
        if quiet_rank:
            err.silent = True
        elif first:
            guard.stop_new_children(before)
            err.kept = settle_checkpoints(out)
        raise
    except BaseException as err:  # torch's CheckpointException is a BaseException
        from porting.convert.checkpoint import disk_full_error
        from porting.errors import PortingError

        # Judged now, while the partial checkpoint still fills the disk; Megatron's writer
        # loses the errno on the way ("unexpected pos 704 vs 598").
        full = disk_full_error(err, out)
        if full is None:
            raise
        guard.stop_new_children(before)
        kept = f"; {settle_checkpoints(out)}" if first else ""
        raise PortingError(f"no space left on the device writing {out}{kept}") from err


def launched(launch: Callable[[], int], out: Path) -> int:
    """Run ``launch()`` (a launcher of ranks: torchrun, NeMo-Run) with a private ``TMPDIR`` under
    ``out``; return its exit status. On SIGINT / SIGTERM (or any error) every process it started
    is stopped (:func:`stop_ranks`) and the run directory settled (:func:`settle_checkpoints`):
    one line says what is kept."""
    import psutil

    before = guard.child_pids()
    with private_tmpdir(out) as tmp:
        # the ranks know their launcher by this directory's token, not by the variable alone
        handed = handoff.hand_off(
            LAUNCHER_ENV, tmp, pid=os.getpid(), created=psutil.Process().create_time()
        )
        previous = {name: os.environ.get(name) for name in ("TMPDIR", *handed)}
        os.environ.update(handed | {"TMPDIR": str(tmp)})
        try:
            code = launch()
        except BaseException as err:
            stop_ranks(before)
            if isinstance(err, KeyboardInterrupt | guard.Terminated):
                err.kept = settle_checkpoints(out)
            raise
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    if code != 0:
        print(f"porting train: {settle_checkpoints(out)}", file=sys.stderr)
    return code


def stop_ranks(before: set[int], grace: float = 60.0) -> None:
    """Stop every process started since ``before``: launchers are frozen first (torchrun would
    report its ranks' exit as a failure, with a traceback), ranks and their children get SIGTERM
    and ``grace`` seconds to end, then everything left is killed."""
    import psutil

    try:
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    except psutil.Error:
        return
    ranks, launchers = [], []
    for p in procs:
        try:
            (ranks if "LOCAL_RANK" in p.environ() else launchers).append(p)
        except psutil.Error:
            continue
    for p in launchers:
        with contextlib.suppress(psutil.Error):
            p.suspend()
    for p in ranks:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _wait_gone(ranks, grace)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _wait_gone(procs, 10)


def _wait_gone(procs, timeout: float) -> None:
    # A rank of a frozen launcher stays a zombie (nobody reaps it): ended, for this purpose.
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                alive += p.status() != psutil.STATUS_ZOMBIE
        if not alive:
            return
        time.sleep(0.1)


@contextlib.contextmanager
def private_tmpdir(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory under ``out`` for a launcher and its ranks (``TMPDIR``), removed
    after; those a killed launcher left are removed first (the caller holds the run's lock)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out / f"{TMP_PREFIX}{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
