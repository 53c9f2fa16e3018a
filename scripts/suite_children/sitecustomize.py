"""Counts the interpreters a test suite run starts (scripts/bench_suite.py --children).

On ``PYTHONPATH`` with ``PORTING_PROC_LOG=DIR`` set, every Python process started below writes
one small JSON file into DIR as it starts: its command line and the test it was started for
(pytest's ``PYTEST_CURRENT_TEST``, which a child inherits). Nothing else is done, nothing is
printed, and without ``PORTING_PROC_LOG`` this module does nothing. A test that sets its own
``PYTHONPATH`` for a child (an outside family's site, the owners' environment) hides that child.
"""

import os

_DIR = os.environ.get("PORTING_PROC_LOG")
if _DIR:
    import json
    import sys
    import time

    try:
        with open(os.path.join(_DIR, f"{os.getpid()}-{time.time_ns()}.json"), "w") as _f:
            json.dump(
                {
                    "argv": getattr(sys, "orig_argv", sys.argv)[:8],
                    "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                },
                _f,
            )
    except OSError:
        pass
