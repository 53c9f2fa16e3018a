"""The `porting` command line: a thin typed layer over library functions.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds a parser
whose ``func`` default takes the parsed namespace and returns an exit code. Modules are listed
explicitly so that registration is never accidental. Heavy imports (NeMo, Megatron, torch) happen
inside the command functions, so ``porting --help`` stays fast.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import importlib
import logging
import os
import select
import signal
import sys
import traceback

from porting import guard, quiet
from porting.errors import PortingError

_SUBCOMMAND_MODULES = (
    "porting.commands.convert",
    "porting.commands.families",
    "porting.commands.verify",
    "porting.commands.demo",
    "porting.commands.train",
    "porting.commands.prep_data",
    "porting.commands.plan",
)


_OWN_PACKAGES = ("porting", "models", "converters", "data_prep")


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="porting",
        description="Import Hugging Face checkpoints into NeMo 2.0 / Megatron-Core, verify "
        "logit parity, export back, prepare data and plan training.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging, and every third-party warning and notice (hidden by default)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _whole_flags_only(parser)
    return parser


def _whole_flags_only(parser: argparse.ArgumentParser) -> None:
    """No abbreviated flags, in this parser and every subcommand's: ``--exec torchrun`` would be
    taken for ``--executor``, while the launchers that rebuild a rank's arguments (and a reader
    of a script or a log) know the full spellings only."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _whole_flags_only(child)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # what was typed, for the launchers that start ranks of the same command
    args.typed = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    quiet.install(args.verbose)
    # Our packages log at INFO; third-party libraries only from WARNING up unless -v.
    handler = logging.StreamHandler()
    handler.setFormatter(_Voice(args.verbose))
    # does nothing where the root logger already has a handler (an application embedding us)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, handlers=[handler]
    )
    for name in _OWN_PACKAGES:
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    before = guard.child_pids()
    from porting.convert import ranks

    try:
        with guard.signals_as_exceptions():
            try:
                if ranks.staging() is not None:  # a rank of a launched conversion ends with it
                    guard.die_with_parent()
                code = int(args.func(args) or 0)
            except BaseException as err:
                ranks.record_failure(err)
                stop = guard.stopped_by(err)
                if stop is None or stop is err:
                    raise
                # wrapped by a library (torch's CheckpointException) or ended otherwise after the
                # signal: still the signal's stop, not a crash
                raise stop from err
            guard.raise_if_stopped()  # the signal's exception lost in a finalizer: not a success
            sys.stdout.flush()  # a closed pipe is said here, not as a traceback at exit
            return code
    except PortingError as err:
        print(f"porting {args.command}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        # Our commands return their exit code and never exit; a SystemExit from inside one was
        # raised by a library or a family plugin mid-way, before the command's output was made.
        # Its code is no verdict on the command: exit 0 here would claim output that is not there.
        print(
            f"porting {args.command}: error: {_exit_source(exit_)} called sys.exit"
            f"({exit_.code!r}) before the command finished; it did not complete",
            file=sys.stderr,
        )
        return 2
    except BrokenPipeError:
        if not _stdout_gone():  # a worker's or a child's pipe: a failure, said as one
            raise
        # stdout's reader went away (`porting verify ... | head`): the rest has nowhere to go,
        # and without this Python prints a traceback, then another flushing stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except (MemoryError, RuntimeError) as err:
        said = _out_of_memory(err)
        if said is None:
            raise
        # unwound like any failure: partial outputs removed on the way out
        print(
            f"porting {args.command}: error: out of memory ({said}); partial output removed",
            file=sys.stderr,
        )
        return 2
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        # Partial outputs were removed on the way out (atomic directories, prep-data's temp files).
        print(
            f"porting {args.command}: error: no space left on the device writing "
            f"{err.filename or 'the output'}; partial output removed",
            file=sys.stderr,
        )
        return 2
    except (guard.Terminated, KeyboardInterrupt) as stop:
        # Workers, and the helpers Megatron's checkpoint writer and multiprocessing start, must
        # not outlive a stopped command (a normal exit shuts them down through atexit).
        guard.stop_new_children(before)
        code = stop.exit_code if isinstance(stop, guard.Terminated) else 130
        if getattr(stop, "silent", False) or _a_launched_rank(args):
            return code
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else str(stop)
        kept = getattr(stop, "kept", None) or "partial outputs removed"
        print(f"porting {args.command}: stopped by {name}; {kept}", file=sys.stderr)
        return code


def _out_of_memory(err: BaseException) -> str | None:
    """What an allocation that failed said (a ``MemoryError``, torch's CPU allocator refusing,
    a device out of memory), or None for any other error."""
    if isinstance(err, MemoryError):
        return str(err) or "MemoryError"
    text = str(err)
    if type(err).__name__ != "OutOfMemoryError" and "can't allocate memory" not in text:
        return None
    # torch's allocator message starts with the C++ assertion that failed
    text = text[text.find("DefaultCPUAllocator") :] if "DefaultCPUAllocator" in text else text
    return (text.strip().splitlines() or [type(err).__name__])[0][:300]


def _a_launched_rank(args) -> bool:
    """Whether this is a rank of a `porting train` launcher of ours, which says how the run
    stopped: however the stop reached the rank (torchrun forwards the group's SIGTERM, and the
    second one can arrive while the first unwinds, past the rank's own settle), it prints nothing."""
    if args.command != "train" or "RANK" not in os.environ:
        return False
    from porting.train import stop

    return stop.launcher() is not None


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


class _Voice(logging.Formatter):
    """Our packages' records read as the command's own lines (``resuming ...``,
    ``warning: ...``, ``error: ...``), not as a logger's (``INFO porting.convert.checkpoint: ...``); a third-party
    record keeps its origin, and with ``-v`` every record shows where it comes from."""

    def __init__(self, verbose: bool) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        if self.verbose or record.name.partition(".")[0] not in _OWN_PACKAGES:
            return super().format(record)
        text = record.getMessage()
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


def _exit_source(exit_: SystemExit) -> str:
    """Where ``exit_`` was raised: the innermost frame's ``file:line``."""
    frames = traceback.extract_tb(exit_.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "a library"


_EXIT_CODE: int | None = None


def run() -> None:
    """The ``porting`` console script: :func:`main`, then Python's exit, which waits for the
    threads and runs every exit handler (temporary directories, logging, child processes), and
    the process ends there. The interpreter's teardown of torch, Megatron-Core and transformers
    that would follow takes 2-3 s on these two cores and frees only memory the OS takes back."""
    global _EXIT_CODE
    atexit.register(_end_now)  # registered first, so it runs after every library's handler
    guard.one_command_process()
    _EXIT_CODE = main()
    sys.exit(_EXIT_CODE)


def _end_now() -> None:
    if _EXIT_CODE is None:  # main() raised: Python's own exit reports it, with its status
        return
    logging.shutdown()  # registered on import of logging, before this: its flush is still owed
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed: nothing more to say
            pass
    os._exit(_EXIT_CODE)


if __name__ == "__main__":
    run()
