"""Runs that neither trample each other nor leave debris behind.

- :func:`output_lock`: one writer per output. An advisory ``fcntl`` lock on a hidden file beside the
  output (``.NAME.lock``); a second run on the same output fails at once, naming the first run's pid.
- :func:`signals_as_exceptions`: SIGTERM and SIGHUP (what Slurm, Kubernetes and a closed terminal
  send) raise :class:`Terminated` in the main thread, as SIGINT raises ``KeyboardInterrupt``, so the
  same ``finally`` / ``except BaseException`` blocks remove partial outputs.
- :func:`signals_deferred`: a block that SIGINT, SIGTERM and SIGHUP do not interrupt (a rename
  that must complete, a loop that must stop its own workers first); the first signal is handled
  as the block ends, and the block can ask whether one is pending.
- :func:`refuse_overlap`: an output that is, lies inside or contains an input is refused before
  anything is written, ``--overwrite`` or not (replacing it would destroy the input).
  :func:`check_outputs` is what a command calls: every path it writes against every path it
  reads, and a file output's directory checked, before any work.
- :func:`stop_new_children`: terminates every process started since a snapshot (our workers,
  multiprocessing managers and resource trackers that Megatron's checkpoint writer starts).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from porting.errors import PortingError


class Terminated(BaseException):
    """A termination signal arrived; carries the signal and what the command kept.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that library code catching ``Exception``
    does not swallow it. ``kept`` is set by a command that keeps something on purpose (a resume
    state) and is printed in the one closing line.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.kept: str | None = None

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process killed by it (143, 129)."""
        return 128 + self.signum


_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

# The signal that stopped this process's command, once one has arrived. Kept apart from the
# exception: a handler that runs inside a finalizer (``__del__``, ``weakref.finalize``) has its
# exception printed and dropped, and library code that catches ``BaseException`` may wrap it
# (torch's ``CheckpointException``) or drop it; the command must stop all the same.
_stopped: list[int] = []


def _raise_terminated(signum: int, frame) -> None:
    # Further signals during the clean-up would interrupt it half-way; the first one decides.
    for sig in (*_SIGNALS, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _stopped.append(signum)
    raise Terminated(signum)


def raise_if_stopped() -> None:
    """Raise :class:`Terminated` again if a termination signal arrived and its exception was lost
    on the way (see ``_stopped``): called before an output is put in place and as a command ends,
    so that a stopped run never reports success."""
    if _stopped:
        raise Terminated(_stopped[0])


def signal_arrived() -> bool:
    """Whether a stop signal reached this process's command (SIGINT only inside
    :func:`sigint_recorded`): a ``KeyboardInterrupt`` or :class:`Terminated` raised by code,
    with no signal behind it, is that code's failure, not the user's stop."""
    return bool(_stopped)


@contextlib.contextmanager
def sigint_recorded() -> Iterator[None]:
    """Within the block, Ctrl-C still raises ``KeyboardInterrupt`` and is also recorded, so that
    :func:`signal_arrived` tells it from a ``raise KeyboardInterrupt`` in code run there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return

    def record(signum: int, frame) -> None:
        _stopped.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stopped_by(err: BaseException) -> BaseException | None:
    """The stop (:class:`Terminated`, ``KeyboardInterrupt``) behind ``err``: itself, one in its
    causes or contexts, or the signal recorded while it propagated; None when there is none."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Terminated | KeyboardInterrupt):
            return e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        # torch.distributed.checkpoint's CheckpointException: {rank: (exception, traceback)}
        failures = getattr(e, "failures", None)
        for failure in failures.values() if isinstance(failures, dict) else ():
            failure = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(failure, BaseException):
                todo.append(failure)
    return Terminated(_stopped[0]) if _stopped else None


@contextlib.contextmanager
def interrupts_as_terminated() -> Iterator[None]:
    """Within the block SIGINT, too, raises :class:`Terminated` (exit status 130), for code that
    handles ``KeyboardInterrupt`` its own way: Lightning's trainer turns it into ``exit(1)``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:  # started ignoring it (a background job): keep ignoring it
        yield
        return
    signal.signal(signal.SIGINT, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated`; handlers restored after."""
    _stopped.clear()
    # SIGINT too: the first stop ignores it for the clean-up, and this block ends that
    previous = {sig: signal.getsignal(sig) for sig in (*_SIGNALS, signal.SIGINT)}
    for sig in _SIGNALS:
        signal.signal(sig, _raise_terminated)
    reported = sys.unraisablehook

    def unraisable(hook_args) -> None:
        # The handler ran inside a finalizer (a weakref callback of importlib's, a __del__), whose
        # exception Python prints with a traceback and drops: the stop is recorded (_stopped) and
        # raised again where it counts, and the command's one closing line says it.
        if isinstance(hook_args.exc_value, Terminated) and _stopped:
            return
        reported(hook_args)

    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = reported
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stopped.clear()  # the stop was this block's; a later one in this process starts afresh


def refuse_overlap(outputs, inputs, flag: str = "--out") -> None:
    """Raise :class:`PortingError` when any of ``outputs`` (paths this run will write or replace)
    is, lies inside, or contains any of ``inputs`` (``(what, path)`` pairs; a path of None is
    skipped): with ``--overwrite`` the input would be destroyed, without it a later run would read
    its own output as input.

    Compared after resolving symlinks, and by file identity (device and inode) along both paths,
    which also sees a bind mount or a second spelling on a case-insensitive file system."""
    if isinstance(outputs, str | os.PathLike):
        outputs = [outputs]
    seen = []
    for what, given in inputs:
        if given is None:
            continue
        seen.append((what, given, _Place(Path(os.path.realpath(given)))))
        # An HF hub snapshot's files are links into the repository's blobs/: the input's bytes
        # live where its links lead, and an output there destroys the input all the same.
        for name, target in _linked_entries(given):
            seen.append((f"{what}'s {name} (a link)", target, _Place(target)))
    for out in outputs:
        o = _Place(Path(os.path.realpath(out)))
        for what, given, i in seen:
            how = o.against(i)
            if how is None:
                continue
            via = f" ({o.path} after symlinks)" if Path(out).absolute() != o.path else ""
            raise PortingError(
                f"{flag} {out}{via} {how} the {what} {given}; choose an output outside every "
                "input (nothing was written)"
            )


def _linked_entries(path) -> list[tuple[str, Path]]:
    """``(name, real path)`` of each symbolic link directly inside the directory ``path``."""
    try:
        entries = list(os.scandir(path))
    except (NotADirectoryError, FileNotFoundError, PermissionError):
        return []
    return [(e.name, Path(os.path.realpath(e.path))) for e in entries if e.is_symlink()]


class _Place:
    """A resolved path with the identities (``st_dev``, ``st_ino``) of itself, if it exists, and
    of each existing directory above it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.own: tuple[int, int] | None = None
        self.above: set[tuple[int, int]] = set()
        for depth, p in enumerate([path, *path.parents]):
            try:
                st = os.stat(p)
            except OSError:
                continue
            if depth:
                self.above.add((st.st_dev, st.st_ino))
            else:
                self.own = (st.st_dev, st.st_ino)

    def against(self, i: _Place) -> str | None:
        """How this output stands to the input ``i``: "is", "lies inside", "contains" or None."""
        if self.path == i.path or (self.own is not None and self.own == i.own):
            return "is"
        if self.path.is_relative_to(i.path) or (i.own is not None and i.own in self.above):
            return "lies inside"
        if i.path.is_relative_to(self.path) or (self.own is not None and self.own in i.above):
            return "contains"
        return None


def check_outputs(reads, writes=(), files=()) -> None:
    """Refuse, before any work, a command whose outputs would touch its inputs.

    ``reads``: ``(what, path)`` for every path the command reads (a flag or a name: ``--hf-config``,
    ``HF directory``). ``writes``: ``(flag, path)`` for every directory or prefix it creates or
    replaces (its parents made as needed). ``files``: ``(flag, path)`` for every single file it
    writes at the end (a plot, a YAML): its directory must exist and the path must not be a
    directory, so that a long run does not fail only when it is done. A path of None is skipped;
    an output whose name (or the working directory it is under) holds a control character is
    refused (:func:`porting.shell.checked`).
    """
    from porting.shell import checked

    outputs = [(flag, path) for flag, path in [*writes, *files] if path is not None]
    for flag, path in outputs:
        # an output's name reaches messages, logs and the scripts that launchers write
        checked(str(Path(path).absolute()), flag)
        refuse_overlap(path, reads, flag)
    # Two outputs of one run in one place: the later write replaces or lands inside the earlier.
    for i, (flag, path) in enumerate(outputs):
        refuse_overlap(path, [(f"output of {f}", p) for f, p in outputs[i + 1 :]], flag)
    for flag, path in files:
        if path is None:
            continue
        path = Path(path)
        if path.is_dir():
            raise PortingError(f"{flag} {path}: a directory; give a file name (nothing was run)")
        if not path.absolute().parent.is_dir():
            raise PortingError(
                f"{flag} {path}: no directory {path.absolute().parent} to write it in; create it "
                "first (nothing was run)"
            )


def child_pids() -> set[int]:
    """Pids of every live descendant of this process."""
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


@contextlib.contextmanager
def signals_deferred() -> Iterator[Callable[[], int | None]]:
    """Within the block SIGINT, SIGTERM and SIGHUP wait; the first one to arrive is handled as it
    would have been (``KeyboardInterrupt``, :class:`Terminated`) as the block ends.

    Yields ``pending()``: the signal waiting, or None, for a loop that should wind down early.
    Handlers can only be changed in the main thread; elsewhere (a test's thread) the block runs
    as it is.
    """
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in sigs}
    for sig in sigs:
        signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        yield lambda: got[0] if got else None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if got:
            handler = previous[got[0]]
            if callable(handler):
                handler(got[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), got[0])


def stop_new_children(before: set[int], timeout: float = 5.0) -> int:
    """Terminate (then kill) descendants that are not in ``before``; returns how many were left."""
    import psutil

    # multiprocessing's resource tracker ignores SIGTERM by design and exits with this process;
    # stopping it would only cost the timeout and make Python relaunch it at exit.
    tracker = _resource_tracker_pid()
    try:
        procs = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.pid != tracker
        ]
    except psutil.Error:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)
    return len(procs)


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)


def lock_path(output: str | os.PathLike) -> Path:
    """The lock file of ``output``: ``.NAME.lock`` in the same directory."""
    output = Path(output)
    return output.with_name(f".{output.name}.lock")


# Locks this process holds (lock file -> depth): the CLI takes an output's lock before its heavy
# imports, so that a second run fails at once, and the library function it calls takes it again.
_HELD: dict[Path, int] = {}


@contextlib.contextmanager
def output_lock(output: str | os.PathLike, what: str) -> Iterator[Path]:
    """Hold the advisory lock of ``output`` for the block, or fail at once naming its holder.

    Re-entrant within a process. The lock file is removed on release. A run that opened the file
    just before it was removed finds its inode gone and tries again, so two runs never both
    believe they hold the lock.
    """
    path = lock_path(output).absolute()
    if path in _HELD:
        _HELD[path] += 1
        try:
            yield path
        finally:
            _HELD[path] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise PortingError(
                    f"{output}: another porting run (pid {holder}) is writing this {what}; "
                    f"wait for it to finish or stop it (lock: {path})"
                ) from None
            raise
        try:
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
    _HELD[path] = 1
    try:  # entered right after the lock is won: a signal from here on removes the file
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        del _HELD[path]
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_RETURN_THRESHOLD = 1 << 20
_TRIM_DEFAULT = 128 << 10  # glibc's own
_returning = False  # return_freed_memory() is in effect
_reusing = False  # a ReusedHeap is in effect


def _libc():
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    # a C library without them (musl) is left as it is
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def return_freed_memory() -> None:
    """Make freed tensor buffers go back to the OS at once (glibc only; a no-op elsewhere).

    glibc serves allocations below its mmap threshold from the heap, and raises that threshold
    (up to 32 MiB) each time a larger block is freed; a conversion that frees one 32 MiB tensor
    after another then keeps the freed ones as heap fragments, and its resident memory grows with
    the number of layers. A fixed 1 MiB threshold maps every tensor separately and unmaps it on
    free.
    """
    global _returning
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _RETURN_THRESHOLD)  # fixed, so never raised
        _returning = True


_one_command = False  # this process runs one `porting` command, then exits (porting.cli.run)


def one_command_process() -> None:
    """Mark this process as the console script's: one command, then exit."""
    global _one_command
    _one_command = True


def keep_loaded_out_of_collections() -> None:
    """In a command's own process, once its libraries are loaded: every object alive now is left
    out of the garbage collector's later passes (``gc.freeze``).

    The libraries' millions of objects live until the process exits, and each full collection
    walks them all again (~0.8 s over NeMo's heap on these cores); a conversion collects after
    each model it lets go, to give that memory back at once, and then walks only what it made
    since. A frozen object freed by reference counting still goes at once. Nothing is frozen in
    a process that embeds us (``porting.cli.main`` or ``porting.api`` called by its own code):
    its objects would never be collected.
    """
    if _one_command:
        import gc

        gc.freeze()


class ReusedHeap:
    """Within (``with``): blocks under ``threshold`` come from glibc's heap, and a freed one
    serves the next allocation of its size instead of going back to the OS; after:
    :func:`return_freed_memory`'s setting again, the heap trimmed.

    For a loop that allocates the same activations in each step (the streamed gate, layer after
    layer). Returned at once, each of them is mapped afresh in the next step, and the kernel
    faults in and zeroes every page again: 4.4 M page faults and ~10 s of system time on an
    8-layer 7B-shaped gate, against ~11 s of matmuls. Larger blocks (a layer's weights, which the
    gate keeps in reused buffers anyway) are still mapped and unmapped.

    The heap can fragment: on a 32-layer 7B-shaped gate it grew by 15-30 MB a layer in some
    runs (not in others: the order of frees depends on the reader thread). So a loop calls
    :meth:`step` after each step, and each time the heap has grown by ``slack`` since the last
    trim its free pages go back to the OS (to be faulted in again where reused): its resident
    size then has a bound that does not grow with the steps. Measured on that gate, this alone:
    5.0 M page faults and 16 s of system time against 12.0 M and 32 s, peak RSS 2.90 GB against
    2.72 GB.

    A no-op where :func:`return_freed_memory` is not in effect (glibc's own threshold keeps
    freed blocks already) or glibc (2.33 on, for ``mallinfo2``) is not the allocator.
    """

    def __init__(self, threshold: int = 64 << 20, slack: int = 256 << 20) -> None:
        self.threshold = threshold
        self.slack = slack
        self._libc = None
        self._trimmed_at: int | None = None

    def __enter__(self) -> ReusedHeap:
        global _reusing
        libc = _libc() if _returning and not _reusing else None  # an inner one is a no-op
        if libc is None or not hasattr(libc, "mallinfo2"):
            return self
        # an older glibc (2.34 and before) refuses a threshold above 32 MiB
        if not any(libc.mallopt(_M_MMAP_THRESHOLD, t) for t in (self.threshold, 32 << 20)):
            return self
        libc.mallinfo2.restype = _MallInfo2
        libc.mallopt(_M_TRIM_THRESHOLD, -1)  # step() trims, not every free at the top
        self._libc, self._trimmed_at, _reusing = libc, None, True
        return self

    def step(self) -> None:
        """A step of the loop is over: trim if the heap has grown by ``slack`` since the last."""
        if self._libc is None:
            return
        size = self._libc.mallinfo2().arena
        if self._trimmed_at is None:
            self._trimmed_at = size
        elif size - self._trimmed_at > self.slack:
            self._libc.malloc_trim(0)
            self._trimmed_at = self._libc.mallinfo2().arena  # trimming its top shrinks it

    def __exit__(self, *exc) -> None:
        global _reusing
        libc, self._libc = self._libc, None
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, _RETURN_THRESHOLD)
            libc.mallopt(_M_TRIM_THRESHOLD, _trim_threshold())
            libc.malloc_trim(0)
            _reusing = False


def _trim_threshold() -> int:
    """glibc's trim threshold as this process started with it (its environment's, else 128 KiB)."""
    value = os.environ.get("MALLOC_TRIM_THRESHOLD_", "")
    return int(value) if value.isdigit() and int(value) < 1 << 31 else _TRIM_DEFAULT


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(137)
