"""``--executor ray``: every unit a Ray task (:mod:`data_prep.ray_exec`), merged here.

The staging directory is the job's resume state: a rerun with ``--resume`` runs only the units
not verified done. A stop (a signal, a lost cluster) keeps the finished units; an error of the data
removes them (:func:`data_prep.units.wind_down`).
"""

from __future__ import annotations

import logging
import time

from data_prep.executors.base import UNIT_MB, Flag, PrepConfig, UnitExecutor
from data_prep.sources import Source
from porting.errors import PortingError
from porting.guard import Terminated, signals_deferred

log = logging.getLogger(__name__)


class Ray(UnitExecutor):
    """The units on a Ray cluster (started for the job without ``--ray-address``)."""

    name = "ray"
    help = "units as Ray tasks, merged here"
    flags = (
        Flag(
            "--ray-address",
            "ray_address",
            "an existing Ray cluster (default: start a local instance for the job)",
            metavar="HOST:PORT",
        ),
        UNIT_MB,
    )

    def refuse(self, cfg: PrepConfig) -> None:
        import importlib.util

        # Ray is an extra (porting[ray]): most installs prepare data on one host
        if importlib.util.find_spec("ray") is None:
            raise PortingError(
                "--executor ray: Ray is not installed in this environment; install it with "
                "`pip install 'porting[ray]'` (or choose --executor local)"
            )
        if cfg.ray_address:
            from data_prep.ray_exec import check_reachable

            check_reachable(cfg.ray_address)

    def run_units(
        self, cfg: PrepConfig, sources: list[Source], tok_fp: str, t_start: float
    ) -> dict:
        from data_prep import ray_exec, units

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
        return units.finish(job, summaries, self.name, timing)
