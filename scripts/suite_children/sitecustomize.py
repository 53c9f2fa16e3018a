"""Counts the interpreters a test suite run starts (scripts/bench_suite.py --children).

On ``PYTHONPATH`` with ``PORTING_PROC_LOG=DIR`` set, every Python process started below writes
one small JSON file into DIR as it starts: its command line and the test it was started for
(pytest's ``PYTEST_CURRENT_TEST``, which a child inherits); at a normal exit it writes a second
one with its CPU seconds (at exit, ``os._exit`` included) and which of the heavy libraries it imported (NeMo, Lightning,
Megatron-Core, transformers), the measure of what a child's start-up costs. Nothing else is done,
nothing is printed, and without ``PORTING_PROC_LOG`` this module does nothing. A test that sets
its own ``PYTHONPATH`` for a child (an outside family's site, the owners' environment) hides that
child.
"""

import os

_DIR = os.environ.get("PORTING_PROC_LOG")
if _DIR:
    import atexit
    import json
    import resource  # here: pip refuses imports once an install has started
    import sys
    import time

    _NAME = os.path.join(_DIR, f"{os.getpid()}-{time.time_ns()}")

    def _write(path: str, record: dict) -> None:
        try:
            with open(path, "w") as f:
                json.dump(record, f)
        except OSError:
            pass

    _write(
        _NAME + ".json",
        {
            "argv": getattr(sys, "orig_argv", sys.argv)[:8],
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        },
    )

    def _at_exit() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        loaded = [
            m for m in ("nemo", "lightning", "megatron.core", "transformers") if m in sys.modules
        ]
        _write(_NAME + ".exit", {"cpu_s": usage.ru_utime + usage.ru_stime, "loaded": loaded})

    atexit.register(_at_exit)
    _os_exit = os._exit

    def _exit_recorded(status):
        # a command ends with os._exit (porting.guard), which skips atexit
        _at_exit()
        _os_exit(status)

    os._exit = _exit_recorded
