"""``prep-data --executor ray`` and ``--executor slurm``: plan the units, then run them on Ray
(and merge) or emit them as a Slurm job array.

Imported only for those executors (the local one never imports Ray); it sits above
:mod:`data_prep.units`, :mod:`data_prep.ray_exec` and :mod:`data_prep.slurm`, which import none of
each other's callers.
"""

from __future__ import annotations

import logging
import time

from data_prep import ray_exec, slurm, units
from data_prep.prep import _check_outputs
from data_prep.sources import Source
from porting.errors import PortingError
from porting.guard import Terminated, output_lock, signals_deferred

log = logging.getLogger(__name__)


def prepare(cfg, sources: list[Source], tok_fp: str, t_start: float) -> dict:
    """``prep-data --executor ray`` (tokenize and merge) or ``--executor slurm`` (emit scripts)."""
    if cfg.unit_bytes < 1:
        raise PortingError(f"--unit-mb {cfg.unit_bytes / (1 << 20)}: need a positive size")
    if cfg.executor == "slurm":
        if not cfg.emit:
            raise PortingError("--executor slurm needs --emit DIR (where the scripts go)")
        with output_lock(cfg.output_prefix, "dataset"):
            _check_outputs(cfg, cfg.json_keys)
            job = units.plan_job(cfg, sources, tok_fp)
            units.open_staging(job, cfg.resume)
            return slurm.emit(job, cfg.emit)
    if cfg.ray_address:
        # Before the tokenizer is loaded (seconds): a wrong address is known at once.
        ray_exec.check_reachable(cfg.ray_address)
    with output_lock(cfg.output_prefix, "dataset"):
        _check_outputs(cfg, cfg.json_keys)
        job = units.plan_job(cfg, sources, tok_fp)
        opened = False
        try:
            with signals_deferred():
                resumed = units.open_staging(job, cfg.resume)
                opened = True
            done = {}
            if resumed:
                for u in job.units:
                    s = units.verified(job, u.index)
                    if s is not None:
                        done[u.index] = s
                log.info("resuming: %d of %d units done", len(done), len(job.units))
            summaries, timing = ray_exec.run_units(cfg, job, done)
        except BaseException as err:
            kept = units.wind_down(job, opened, err)
            if isinstance(err, (KeyboardInterrupt, Terminated)):
                err.kept = kept
            raise
        timing["seconds"] = round(time.perf_counter() - t_start, 3)
        timing["units_resumed"] = len(done)
        return units.finish(job, summaries, "ray", timing)
