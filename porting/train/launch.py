"""Launchers for ``porting train``: a Slurm batch script and NeMo-Run (torchrun runs in the CLI)."""

from __future__ import annotations

import os
import shlex
import sys
import threading
from pathlib import Path

from porting.errors import PortingError
from porting.train.checks import TrainSpec


def slurm_script(spec: TrainSpec, argv: list[str], job_name: str = "porting-train") -> str:
    """A Slurm batch script that runs this training with torchrun on every node.

    ``argv`` are the ``porting train`` arguments to repeat on each node (with ``--executor local``).
    """
    cmd = " ".join(shlex.quote(a) for a in argv)
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={spec.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={spec.gpus_per_node}
#SBATCH --exclusive
#SBATCH --output={spec.out}/slurm-%j.out
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${{MASTER_PORT:-29500}}
srun torchrun \\
  --nnodes={spec.nodes} --nproc-per-node={spec.gpus_per_node} \\
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
  -m porting.cli train {cmd}
"""


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
