"""``porting prep-data``'s entry for every executor.

The local executor (:mod:`data_prep.prep`) runs in this process; ``ray`` and ``slurm`` cut the
work into units (:mod:`data_prep.distributed`), imported only then, so a local run never imports
Ray.
"""

from __future__ import annotations

import time

from data_prep import prep


def prepare(cfg: prep.PrepConfig) -> dict:
    """Run one ``prep-data`` with ``cfg.executor``; return the report (written next to the
    outputs; for ``slurm``, what was emitted)."""
    if cfg.executor == "local":
        return prep.prepare(cfg)
    t_start = time.perf_counter()
    sources, tok_fp = prep.checked_inputs(cfg)
    from data_prep import distributed

    return distributed.prepare(cfg, sources, tok_fp, t_start)
