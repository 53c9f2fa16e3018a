"""A worker's initializer, in a module that imports nothing heavy.

A ``spawn``-ed process reads its initializer and arguments from a pipe, importing the
initializer's module on the way. With :func:`data_prep.worker.init` named there, the child
imported numpy and the tokenizer code before reading the rest of the pipe, and the main
process, blocked writing the configuration (the tokenizer travels in it, megabytes), started
the next worker 0.15 s later (measured with 2 workers; the run's first chunks waited on it).
Named here, with the configuration pickled to bytes, the pipe drains at once.
"""

from __future__ import annotations

import pickle


def init(config: bytes) -> None:
    """Build the worker from its pickled :class:`data_prep.worker.WorkerConfig`."""
    from data_prep import worker

    worker.init(pickle.loads(config))
