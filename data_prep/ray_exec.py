"""``prep-data --executor ray``: every unit (:mod:`data_prep.units`) a Ray task, merged here.

Without ``--ray-address`` a local Ray instance is started for the job (``--workers`` CPUs, no
dashboard, its logs and sockets in a temporary directory that is removed after) and stopped at the
end; with one, the job connects to that cluster, after checking within seconds that the address
answers. In a process where Ray is already initialized (tests), that instance is used and left
running.

At most ``--workers`` units run at once (default: the cluster's CPUs). The job description,
with the serialized tokenizer, goes to the object store once, so workers need no tokenizer files
(except for ``--tokenizer-backend megatron``, which loads by path). Ray runs a task again if its
worker dies (``max_retries``); an error of the data (a bad record under ``--on-error fail``)
is not retried, and cancels every other unit in flight at once.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import tempfile
import time

import ray

from data_prep import units
from data_prep.report import Progress
from porting.errors import PortingError
from porting.guard import signals_deferred

log = logging.getLogger(__name__)

#: Runs of one unit after the first, when the worker running it dies (killed, out of memory).
MAX_RETRIES = 3
#: How long an address may take to accept a connection.
CONNECT_TIMEOUT_S = 5.0
#: How often the progress bar is refreshed from the workers' counts.
POLL_S = 0.25


@ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)
def _unit_task(job: units.Job, index: int, tally) -> dict:
    report = None
    if tally is not None:

        def report(*counts):
            tally.put.remote(*counts)

    return units.run_unit(job, index, report)


@ray.remote(num_cpus=0)
class _Tally:
    """Running counts of every unit in flight, for the one progress bar of the job."""

    def __init__(self) -> None:
        self.units: dict[int, tuple] = {}

    def put(self, index: int, *counts) -> None:
        """The latest totals of unit ``index`` (a retried unit starts again from zero)."""
        self.units[index] = counts

    def snapshot(self) -> dict[int, tuple]:
        """Every unit's latest totals."""
        return dict(self.units)


def check_reachable(address: str) -> None:
    """Fail within seconds, naming the address, when nothing listens there (``ray.init`` alone
    retries for minutes)."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise PortingError(f"--ray-address {address}: expected HOST:PORT (or ray://HOST:PORT)")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise PortingError(
            f"--ray-address {address}: no Ray cluster answers there ({err}); start one with "
            "`ray start --head` or leave --ray-address out for a local instance"
        ) from err


class _Session:
    """Ray for one job: started here (and stopped by :meth:`close`), connected to, or reused."""

    def __init__(self, address: str | None, cpus: int | None) -> None:
        self._owned = False
        self._tmp: str | None = None
        t0 = time.perf_counter()
        quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
        # Ray's core worker would replace this process's SIGTERM handler with a native one that
        # kills it on the spot: no units cancelled, no word of what was kept. ray.init is not
        # interrupted either (a half-started instance would be left running).
        os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
        if ray.is_initialized():
            pass
        elif address:
            check_reachable(address)
            try:
                with signals_deferred():
                    ray.init(address=address, **quiet)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise PortingError(f"--ray-address {address}: cannot join ({err})") from err
            except BaseException:
                ray.shutdown()
                raise
            self._owned = True
        else:
            # No usage report is sent from a machine that may have no network.
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            # Short and private: Ray puts Unix sockets under it (107-byte limit on their paths).
            self._tmp = tempfile.mkdtemp(prefix="ray-prep-", dir="/tmp")
            try:
                with signals_deferred():
                    ray.init(
                        num_cpus=cpus or os.cpu_count() or 1,
                        include_dashboard=False,
                        _temp_dir=self._tmp,
                        **quiet,
                    )
            except BaseException:
                ray.shutdown()
                shutil.rmtree(self._tmp, ignore_errors=True)
                raise
            self._owned = True
        self.start_seconds = time.perf_counter() - t0

    def cpus(self) -> int:
        """The cluster's CPUs."""
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def close(self) -> None:
        """Stop (or leave) what this job started (joined)."""
        if self._owned:
            ray.shutdown()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _cancel(refs) -> None:
    """Kill the tasks behind ``refs`` and wait (a few seconds at most) until they are gone, so
    that none writes into a staging directory about to be removed."""
    for ref in refs:
        ray.cancel(ref, force=True)
    if refs:
        ray.wait(list(refs), num_returns=len(refs), timeout=10)


def _failure(job: units.Job, index: int, err: Exception) -> PortingError:
    unit = job.units[index]
    what = f"unit {index} ({job.sources[unit.source].path}, bytes {unit.start}-{unit.end})"
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, PortingError):
            return PortingError(str(cause))
        return PortingError(f"{what} failed: {cause!r}")
    return PortingError(
        f"{what}: its Ray worker was lost {MAX_RETRIES + 1} times ({type(err).__name__}); "
        "rerun with --resume once the cluster is healthy"
    )


def run_units(cfg, job: units.Job, done: dict[int, dict]) -> tuple[list[dict], dict]:
    """Run every unit not in ``done`` on Ray; return all summaries in unit order and timings."""
    session = _Session(cfg.ray_address, cfg.workers)
    try:
        return _run(cfg, job, done, session)
    finally:
        session.close()


def _run(cfg, job: units.Job, done: dict[int, dict], session: _Session):
    t0 = time.perf_counter()
    todo = [u.index for u in job.units if u.index not in done]
    if cfg.unit_order_seed is not None:
        random.Random(cfg.unit_order_seed).shuffle(todo)
    limit = cfg.workers or session.cpus()
    job_ref = ray.put(job)
    tally = _Tally.remote() if cfg.show_progress else None
    total = sum(s.size for s in job.sources)
    progress = Progress(total, sum(s["disk_bytes"] for s in done.values()), cfg.show_progress)
    summaries = dict(done)
    live: dict[int, tuple] = {}
    in_flight: dict = {}
    finished = 0
    # Ray's calls cannot be interrupted by a Python exception (one raised by a signal handler
    # inside ray.wait comes out as a SystemError): a stop waits for the next poll, at most
    # POLL_S, cancels the units in flight and is raised as the block ends.
    try:
        with signals_deferred() as stopping:
            while (todo or in_flight) and not stopping():
                while todo and len(in_flight) < limit:
                    index = todo.pop(0)
                    in_flight[_unit_task.remote(job_ref, index, tally)] = index
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    index = in_flight.pop(ref)
                    try:
                        summary = ray.get(ref)
                    except ray.exceptions.RayError as err:
                        raise _failure(job, index, err) from None
                    summary["finished"] = finished
                    finished += 1
                    summaries[index] = summary
                    live[index] = (
                        sum(summary["keys"][k]["documents"] for k in job.json_keys[:1]),
                        sum(summary["keys"][k]["tokens"] for k in job.json_keys),
                        summary["bytes"],
                        summary["disk_bytes"],
                    )
                    if cfg.stop_after_units is not None and finished >= cfg.stop_after_units:
                        raise KeyboardInterrupt
                if tally is not None:
                    counts = ray.get(tally.snapshot.remote())
                    for index, c in counts.items():
                        if index not in summaries:
                            live[index] = c
                    docs, tokens, nbytes, disk = (
                        sum(c[i] for c in live.values()) for i in range(4)
                    )
                    progress.show(disk, docs, tokens, nbytes)
            if stopping():
                _cancel(list(in_flight))
                in_flight.clear()
    except BaseException:
        _cancel(list(in_flight))
        progress.close()
        raise
    progress.close()
    timing = {
        "ray_start_seconds": round(session.start_seconds, 3),
        "processing_seconds": round(time.perf_counter() - t0, 3),
        "workers": limit,
        "units": len(job.units),
    }
    return [summaries[u.index] for u in job.units], timing
