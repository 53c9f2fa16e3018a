"""``--executor slurm --emit DIR``: the units as a Slurm job array and a merge job, written to
``DIR`` by :mod:`data_prep.slurm`; nothing is submitted."""

from __future__ import annotations

from pathlib import Path

from data_prep.executors.base import UNIT_MB, Flag, PrepConfig, UnitExecutor
from data_prep.sources import Source
from porting.errors import PortingError


class Slurm(UnitExecutor):
    """Plans and stages the job here; the array tasks and the merge run wherever Slurm puts them."""

    name = "slurm"
    help = "write a job array and a merge job to --emit DIR (not submitted)"
    flags = (
        UNIT_MB,
        Flag("--emit", "emit", "where --executor slurm writes its scripts", metavar="DIR"),
    )

    def writes(self, cfg: PrepConfig) -> list[tuple[str, str | Path | None]]:
        return [*super().writes(cfg), ("--emit", cfg.emit)]

    def refuse(self, cfg: PrepConfig) -> None:
        if not cfg.emit:
            raise PortingError("--executor slurm needs --emit DIR (where the scripts go)")

    def run_units(
        self, cfg: PrepConfig, sources: list[Source], tok_fp: str, t_start: float
    ) -> dict:
        from data_prep import slurm, units

        job = units.plan_job(cfg, sources, tok_fp)
        units.open_staging(job, cfg.resume)
        return slurm.emit(job, cfg.emit)

    def summary(self, result: dict) -> str:
        return (
            f"{result['emit']}: {result['units']} units; submit with {result['emit']}/submit.sh "
            f"(staging {result['staging']})"
        )
