"""``porting prep-data``'s entry for every executor (:mod:`data_prep.executors`)."""

from __future__ import annotations

from data_prep.executors import executor_for
from data_prep.executors.base import PrepConfig


def prepare(cfg: PrepConfig) -> dict:
    """Run one ``prep-data`` with ``cfg.executor``; return the report (written next to the
    outputs; for ``slurm``, what was emitted)."""
    return executor_for(cfg.executor).run(cfg)
