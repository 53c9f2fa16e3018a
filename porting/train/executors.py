"""Where ``porting train`` runs (``--executor``): this process, torchrun ranks on this node,
Slurm, or NeMo-Run (:mod:`porting.launch`'s interface). An executor that starts ranks runs each
with the same arguments and ``--executor local``; the checks that need no trainer have been made
before it starts (``porting.commands.train``). Importing this module is cheap: the command line
lists the executors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

from porting import guard, launch
from porting.errors import PortingError


class TrainExecutor(launch.Executor):
    """Where one training run's processes start."""

    #: The training loops (``--engine``) it can launch, and what to say for another.
    engines: ClassVar[tuple[str, ...]] = ("nemo2", "bridge")
    other_engine: ClassVar[str] = ""

    def start(self, args, spec, argv: list[str]) -> int:
        """Start the run's ranks, each running ``porting train ARGV``, and wait for them; the
        exit code. ``args``: the command's own (its executor's flags)."""
        raise NotImplementedError(f"--executor {self.name} starts no ranks")


class Local(TrainExecutor):
    name = "local"
    help = "this process (or the rank torchrun/srun started)"


class Torchrun(TrainExecutor):
    name = "torchrun"
    help = "start --gpus-per-node processes here"
    starts_ranks = True

    def start(self, args, spec, argv: list[str]) -> int:
        """This node's ranks, under the run's lock."""
        if spec.nodes != 1:
            raise PortingError("--executor torchrun starts processes on this node only; use slurm")
        torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
        cmd = [
            torchrun, "--standalone", f"--nproc-per-node={spec.gpus_per_node}", "-m",
            "porting.cli", "train", *argv,
        ]  # fmt: skip
        with guard.output_lock(spec.out, "training run"):
            return run_ranks(cmd, Path(spec.out))


class Slurm(launch.Scheduled, TrainExecutor):
    name = "slurm"
    help = "submit OUT/slurm/train.sbatch (torchrun on every node) and follow it"

    def start(self, args, spec, argv: list[str]) -> int:
        """OUT/slurm/train.sbatch written, submitted and followed to its end (or only written,
        or handed over once submitted)."""
        from porting import slurm
        from porting.train import launch as train_launch

        if not args.no_submit:
            self.check_submit()
        text = train_launch.slurm_script(
            spec, argv, cpu_nodes=args.cpu_nodes, partition=args.partition,
            time_limit=args.time_limit,
        )  # fmt: skip
        script = Path(spec.out).absolute() / "slurm" / "train.sbatch"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
        if args.no_submit:
            print(f"wrote {script}; submit with: sbatch {script}")
            return 0
        job = slurm.sbatch([str(script)], "the training job")
        log_file = script.parent / f"job-{job}.out"
        print(f"submitted Slurm job {job} ({spec.nodes} nodes); log {log_file}", flush=True)
        if args.no_wait:
            print(f"follow with: tail -f {log_file}; stop with: scancel {job}")
            return 0
        train_launch.follow_slurm(job, log_file, out=Path(spec.out))
        return 0


class NemoRun(TrainExecutor):
    name = "nemo-run"
    help = "launch through NeMo-Run's LocalExecutor with its torchrun launcher"
    starts_ranks = True
    engines = ("nemo2",)
    other_engine = (
        "--executor nemo-run comes with NeMo 2; launch --engine bridge with torchrun or slurm"
    )

    def start(self, args, spec, argv: list[str]) -> int:
        """NeMo-Run's LocalExecutor with its torchrun launcher, under the run's lock."""
        from porting.train import launch as train_launch
        from porting.train import stop

        with guard.output_lock(spec.out, "training run"):
            return stop.launched(lambda: train_launch.launch_nemo_run(spec, argv), Path(spec.out))


#: Every executor of a training run by its ``--executor`` name, in the order ``--help`` lists them.
EXECUTORS: launch.Executors[TrainExecutor] = launch.Executors(
    Local(), Torchrun(), Slurm(), NemoRun()
)


def run_ranks(cmd: list[str], out: Path) -> int:
    """Run the rank launcher in its own process group; a stop of ours stops every rank with it.

    ``subprocess.call`` would SIGKILL only the launcher on an exception, orphaning its ranks; a
    SIGKILL of this process reaches the launcher and the ranks through
    :func:`porting.train.stop.die_with_parent`.
    """
    from porting.train import stop

    def launch_ranks() -> int:
        # torchrun sets OMP_NUM_THREADS=1 per rank when unset, with a banner saying so; the same
        # value, given, keeps the banner out of the user's terminal. The environment is taken
        # now: stop.launched has handed the ranks their launcher and a private TMPDIR.
        proc = subprocess.Popen(
            cmd, env={"OMP_NUM_THREADS": "1"} | os.environ, start_new_session=True,
            preexec_fn=stop.die_with_parent,
        )  # fmt: skip
        return proc.wait()

    return stop.launched(launch_ranks, out)
