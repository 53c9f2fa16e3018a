"""``--executor local``: this machine, a chunk at a time through ``--workers`` processes
(:mod:`data_prep.prep`), resumable from the last committed chunk."""

from __future__ import annotations

from data_prep.executors.base import Executor, PrepConfig


class Local(Executor):
    """The whole run in this process and its worker pool."""

    name = "local"
    help = "this machine"

    def run(self, cfg: PrepConfig) -> dict:
        from data_prep import prep

        return prep.prepare(cfg)
