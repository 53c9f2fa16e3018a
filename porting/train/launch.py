"""What ``porting train``'s executors (:mod:`porting.train.executors`) run: the Slurm batch
script and its follower, rank 0's verdict for it, and NeMo-Run's launch."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from porting.errors import PortingError
from porting.train.checks import TrainSpec


def slurm_script(
    spec: TrainSpec,
    argv: list[str],
    job_name: str = "porting-train",
    cpu_nodes: bool = False,
    partition: str | None = None,
    time_limit: str | None = None,
) -> str:
    """A Slurm batch script that runs this training with torchrun on every node.

    ``argv`` are the ``porting train`` arguments to repeat on each node (with ``--executor local``).
    It and the job's log live in ``OUT/slurm/``: NeMo's checkpoint callback moves the files at the
    top of the run directory into ``run_N/`` at the first save (a log being written included).
    The rendezvous: :func:`porting.slurm.torchrun_script`.
    """
    from porting import slurm

    return slurm.torchrun_script(
        job_name, spec.nodes, spec.gpus_per_node, Path(spec.out) / "slurm", ["train", *argv],
        gpus_per_node=None if cpu_nodes else spec.gpus_per_node, partition=partition,
        time_limit=time_limit,
    )  # fmt: skip


def verdict_path(out: str | Path, job_id: str) -> Path:
    """Where rank 0 of Slurm job ``job_id`` leaves its verdict: in the run directory, which the
    submitting node reads (NeMo moves what sits at the top of it; ``slurm/`` it leaves)."""
    return Path(out) / "slurm" / f"job-{job_id}.done"


def leave_verdict(out: str | Path, text: str) -> None:
    """Rank 0 of a Slurm job: the run's last line, for the follower that submitted it."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or not job_id.isdigit():
        return
    path = verdict_path(out, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


def follow_slurm(job_id: str, log: Path, poll_s: float = 1.0, out: Path | None = None) -> None:
    """Print the job's log as it grows until the job ends; an error naming how it ended (and the
    log's last lines) unless it completed with rank 0's verdict in ``out`` (a job that completed
    without one did not train where this node looks: a node-local run directory). Ctrl-C,
    SIGTERM or an error while following cancels the job, as ``srun`` does
    (:func:`porting.slurm.follow`).

    A job that ended otherwise (cancelled, failed, timed out) has no rank left: its run directory
    ``out`` is settled here (:func:`porting.train.stop.settle_checkpoints`), so that a checkpoint
    it was writing is removed now, and said, rather than by NeMo on the resume."""
    from porting import slurm
    from porting.train.stop import settle_checkpoints

    job_log = slurm.JobLog(log, stream="stdout")
    restarts = 0

    def poll() -> bool:
        nonlocal restarts
        job_log.show()
        tasks = slurm.tasks(job_id)
        state = tasks[0].get("JobState", "") if tasks else None
        if tasks and int(tasks[0].get("Restarts", "0") or 0) > restarts:
            # Slurm requeues a batch job whose node failed; the script runs again from the
            # top, and `porting train` resumes from the last complete checkpoint.
            restarts = int(tasks[0]["Restarts"])
            print(
                f"Slurm requeued job {job_id} (restart {restarts}): it resumes from its last "
                "complete checkpoint when it runs again",
                flush=True,
            )
        if state == "COMPLETED" or state is None:
            job_log.show()
            if out is not None and verdict_path(out, job_id).is_file():
                return True
            how = "completed" if state else "is no longer known to Slurm"
            raise slurm.JobEnded(
                f"Slurm job {job_id} {how} but rank 0 left no verdict "
                f"({verdict_path(out or '.', job_id)}): nothing is taken as trained. The run "
                "directory must be on a file system that every node sees, not a node-local "
                f"path. Its log {log} ends:\n{slurm.tail(log)}"
            )
        if state in slurm.FAILED_STATES:
            job_log.show()
            longer = " with a longer --time" if state == "TIMEOUT" else ""
            kept = "the checkpoints saved so far are kept"
            if out is not None:
                kept = settle_checkpoints(out)
            raise slurm.JobEnded(
                f"Slurm job {job_id} ended {slurm.ended(tasks[0])}; its log {log} ends:\n"
                f"{slurm.tail(log)}\n{kept}: rerun the same command{longer} to resume from "
                "the last one"
            )
        return False

    slurm.follow(
        [job_id], poll, poll_s=poll_s,
        then="rerun the same command to resume",
    )  # fmt: skip


def launch_nemo_run(spec: TrainSpec, argv: list[str]) -> int:
    """Run ``porting train ARGV`` through NeMo-Run (``LocalExecutor`` with the torchrun launcher).

    NeMo-Run records the experiment under ``OUT/nemo_run``; users who run on a cluster through
    NeMo-Run swap the executor (``run.SlurmExecutor``) in their own script around the same
    ``run.Script``.
    """
    import nemo_run as run

    if spec.nodes != 1:
        raise PortingError("--executor nemo-run launches on this node; use slurm for --nodes > 1")
    os.environ.setdefault("NEMORUN_HOME", str(Path(spec.out).resolve() / "nemo_run"))
    # NeMo-Run finds torchrun on PATH; make it this environment's, as a venv need not be activated.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    script = run.Script(path="porting.cli", args=["train", *argv], entrypoint="python", m=True)
    executor = run.LocalExecutor(ntasks_per_node=spec.gpus_per_node, launcher="torchrun")
    # NeMo-Run waits in a loop that absorbs the exception a stop signal raises (the run would go
    # on), so it waits on a thread and this one takes the signal: porting.train.stop.launched
    # then stops the ranks and settles the run directory.
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            run.run(script, executor=executor, name="porting-train")
        except BaseException as err:
            failure.append(err)

    waiter = threading.Thread(target=wait, name="nemo-run", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.2)
    if failure:
        raise failure[0]
    return 0
