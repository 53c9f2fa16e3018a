"""``--executor slurm``: the units as a Slurm job array and a merge job, written by
:mod:`data_prep.slurm`, then submitted and followed to the dataset's report (``--no-wait``: handed
over once submitted; ``--no-submit``: only written)."""

from __future__ import annotations

import shutil
from pathlib import Path

from data_prep.executors.base import UNIT_MB, Flag, PrepConfig, UnitExecutor
from data_prep.sources import Source
from porting.launch import Scheduled


def emit_flag(cfg: PrepConfig) -> str:
    """How to name the emit directory in an error: the flag it came from."""
    return "--emit" if cfg.emit else "--output-prefix (the default --emit is beside it)"


def emit_dir(cfg: PrepConfig) -> Path:
    """Where the job's scripts and logs go: ``--emit``, else beside the output (which every node
    must see anyway)."""
    return Path(cfg.emit) if cfg.emit else Path(f"{cfg.output_prefix}.prep-data.slurm")


class Slurm(Scheduled, UnitExecutor):
    """Plans and stages the job here; the array tasks and the merge run wherever Slurm puts them."""

    name = "slurm"
    help = "a Slurm job array and a merge job, submitted with sbatch and followed to the end"
    flags = (
        UNIT_MB,
        Flag(
            "--emit",
            "emit",
            "--executor slurm: where the scripts and logs go "
            "(default OUTPUT_PREFIX.prep-data.slurm)",
            metavar="DIR",
        ),
        Flag(
            "--no-submit",
            "no_submit",
            "--executor slurm: write the scripts (DIR/submit.sh) without submitting",
            action="store_true",
        ),
        Flag(
            "--no-wait",
            "no_wait",
            "--executor slurm: return once submitted; follow with `porting prep-data status`",
            action="store_true",
        ),
        Flag("--partition", "partition", "--executor slurm: sbatch's --partition", metavar="NAME"),
        Flag(
            "--time",
            "time_limit",
            "--executor slurm: sbatch's --time for each task and the merge",
            metavar="LIMIT",
        ),
    )

    def writes(self, cfg: PrepConfig) -> list[tuple[str, str | Path | None]]:
        return [*super().writes(cfg), ("--emit", emit_dir(cfg))]

    def refuse(self, cfg: PrepConfig) -> None:
        # each reaches the scripts: a control character would end the line it is written on
        self.check_script_values([
            (emit_flag(cfg), Path(emit_dir(cfg)).absolute()),
            ("--partition", cfg.partition),
            ("--time", cfg.time_limit),
        ])  # fmt: skip
        if not cfg.no_submit:
            self.check_submit()  # before anything is staged

    def run(self, cfg: PrepConfig) -> dict:
        from data_prep import slurm

        handed = super().run(cfg)
        if cfg.no_submit or cfg.no_wait:
            return handed
        # Followed outside the output's lock: the merge job takes it.
        return slurm.follow(handed["emit"], cfg.show_progress)

    def run_units(
        self, cfg: PrepConfig, sources: list[Source], tok_fp: str, t_start: float
    ) -> dict:
        from data_prep import slurm, units

        if not cfg.no_submit:
            slurm.refuse_live(emit_dir(cfg))
        job = units.plan_job(cfg, sources, tok_fp)
        units.open_staging(job, cfg.resume)
        handed = slurm.emit(job, emit_dir(cfg), cfg.partition, cfg.time_limit, emit_flag(cfg))
        if not cfg.no_submit:
            try:
                handed |= slurm.submit(job, handed["emit"])
            except BaseException:
                # Refused before anything ran: no staging left under the output's name, unless
                # it holds units finished earlier (--resume keeps them).
                staging = Path(job.staging)
                if not any(staging.glob("u*.json")):
                    shutil.rmtree(staging, ignore_errors=True)
                raise
        return handed

    def summary(self, result: dict) -> str | None:
        if "outputs" in result:  # followed to the end: the dataset's report
            return None
        if "units_job" not in result:
            return (
                f"{result['emit']}: {result['units']} units; submit with {result['emit']}/submit.sh"
                f" (staging {result['staging']})"
            )
        return (
            f"submitted: unit array {result['units_job']} ({result['submitted_units']} of "
            f"{result['units']} units), merge {result['merge_job']}; follow with `porting prep-data"
            f" status --job {result['emit']}/job.json`; logs in {result['emit']}/logs"
        )
