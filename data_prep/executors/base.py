"""What every ``prep-data`` executor shares: the interface, the flags, and the cut into units.

The flags every executor takes are the fields of :class:`PrepConfig`, checked by
:func:`checked_inputs` before anything is read; an executor's own flags are :class:`Flag` entries
on its class. The command line lists every executor's flags and ``--help`` imports each executor
module, so none of them imports its machinery (Ray, the workers, the tokenizer libraries) before
its :meth:`Executor.run`.

The executors that tokenize units (:class:`UnitExecutor`: ray, slurm) cut the inputs with
:func:`plan_units`, the same way for the same inputs and ``--unit-mb``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from data_prep.report import report_path
from data_prep.sources import MAX_RECORD_BYTES, Source, expand_inputs, line_ranges
from porting import launch
from porting.errors import PortingError
from porting.guard import check_outputs, output_lock
from porting.launch import Flag

if TYPE_CHECKING:
    from data_prep.tokenizer import TokenizerSource

LEVEL = "document"
ON_ERROR = ("fail", "skip")


@dataclass
class PrepConfig:
    """One ``prep-data`` run. Field names follow the command-line flags."""

    inputs: list[str]
    output_prefix: str
    tokenizer: TokenizerSource
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    # None: 1 for the local executor, every CPU of the cluster for ray.
    workers: int | None = 1
    include_special_tokens: bool = True
    use_fast: bool = True
    backend: str = "auto"
    # Load Megatron's tokenizer whatever the tokenizer record says (data_prep.tokenizer).
    recheck_tokenizer: bool = False
    on_error: str = "fail"
    keep_empty: bool = False
    # The .prov sidecar beside each pair (data_prep.provenance); --no-provenance turns it off.
    provenance: bool = True
    allow_empty: bool = False
    resume: bool = False
    overwrite: bool = False
    chunk_bytes: int = 4 << 20
    split: str | None = None
    show_progress: bool = False
    max_record_bytes: int = MAX_RECORD_BYTES
    # Tests: encode in this process (no worker start-up cost).
    in_process: bool = False
    # Tests: die (os._exit) after this many chunks, their tokens flushed but not committed.
    crash_after_chunks: int | None = None
    # A name in data_prep.executors.EXECUTORS.
    executor: str = "local"
    ray_address: str | None = None
    # Input per unit of the ray and slurm executors (a unit is tokenized by one task).
    unit_bytes: int = 256 << 20
    emit: str | None = None
    # --executor slurm: submitted and followed to the dataset's report unless one of these
    no_submit: bool = False
    no_wait: bool = False
    partition: str | None = None
    time_limit: str | None = None
    # Tests: hand units to Ray in an order shuffled with this seed.
    unit_order_seed: int | None = None
    # Tests: stop as if interrupted (KeyboardInterrupt) once this many units are complete.
    stop_after_units: int | None = None


def output_prefix_for(output_prefix: str | Path, key: str) -> Path:
    """``{output_prefix}_{key}_document``, the name Megatron and NeMo give each key's pair."""
    return Path(f"{output_prefix}_{key}_{LEVEL}")


def work_path(output_prefix: str | Path) -> Path:
    """Where an unfinished local run keeps its partial outputs."""
    return Path(f"{output_prefix}.prep-data.partial")


def staging_path(output_prefix: str | Path) -> Path:
    """Where the units of a ray or slurm job are staged."""
    return Path(f"{output_prefix}.prep-data.units")


def checked_inputs(
    cfg: PrepConfig, writes: Iterable[tuple[str, str | Path | None]] = ()
) -> tuple[list[Source], str]:
    """Check the flags every executor shares, and that no output (the dataset's, or ``writes``:
    an executor's own, as ``(flag, path)``) touches an input; return the inputs and the
    tokenizer's fingerprint."""
    keys = tuple(cfg.json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise PortingError(f"--json-keys {' '.join(keys)}: need distinct keys")
    if cfg.on_error not in ON_ERROR:
        raise PortingError(f"--on-error {cfg.on_error}: one of {', '.join(ON_ERROR)}")
    if cfg.workers is not None and cfg.workers < 1:
        raise PortingError(f"--workers {cfg.workers}: need at least 1")
    if cfg.max_record_bytes < 1:
        raise PortingError(f"--max-record-bytes {cfg.max_record_bytes}: need at least 1")
    sources = expand_inputs(cfg.inputs)
    finals = [output_prefix_for(cfg.output_prefix, k) for k in keys]
    outputs = [Path(f"{f}{ext}") for f in finals for ext in (".bin", ".idx", ".prov")]
    outputs += [report_path(cfg.output_prefix), work_path(cfg.output_prefix)]
    contract = cfg.tokenizer.contract
    check_outputs(
        # the directories given as inputs too: an output among their files would be read as
        # input by the next run
        [("input", p) for p in map(Path, cfg.inputs) if p.is_dir()]
        + [("input", s.path) for s in sources]
        + [("tokenizer", cfg.tokenizer.path)]
        + [("tokenizer", contract.checkpoint if contract else None)],
        writes=[("--output-prefix", o) for o in outputs] + list(writes),
    )
    # Here rather than at the top: --help imports this module, and the tokenizer module is not
    # needed to list flags.
    from data_prep.tokenizer import fingerprint

    tok_fp = fingerprint(cfg.tokenizer, cfg.include_special_tokens, cfg.use_fast)
    return sources, tok_fp


def refuse_existing(cfg: PrepConfig) -> None:
    """Refuse to replace a finished dataset without ``--overwrite`` (checked under the lock)."""
    finals = [output_prefix_for(cfg.output_prefix, k) for k in cfg.json_keys]
    existing = [
        p for f in finals for p in (Path(f"{f}.bin"), Path(f"{f}.idx"), Path(f"{f}.prov"))
        if p.exists()
    ]  # fmt: skip
    if existing and not cfg.overwrite:
        raise PortingError(f"{existing[0]} exists; pass --overwrite to replace it")


@dataclass(frozen=True)
class Unit:
    """Input ``source`` from byte ``start`` to ``end`` (a line end), or all of it (``end`` None)."""

    index: int
    source: int
    start: int
    end: int | None


def plan_units(sources: list[Source], unit_bytes: int) -> list[Unit]:
    """Every input in order, plain JSONL files cut into ranges of about ``unit_bytes``."""
    units: list[Unit] = []
    for i, src in enumerate(sources):
        if src.kind == "jsonl":
            for start, end in line_ranges(src, unit_bytes):
                units.append(Unit(len(units), i, start, end))
        else:
            units.append(Unit(len(units), i, 0, None))
    return units


class Executor(launch.Executor, ABC):
    """Where one ``prep-data`` run tokenizes (:class:`porting.launch.Executor`: its name, help
    and flags)."""

    @abstractmethod
    def run(self, cfg: PrepConfig) -> dict:
        """Run ``cfg``: return the dataset's report (also written next to the outputs) or, for an
        executor that leaves the tokenizing to a scheduler, what it handed over."""

    def summary(self, result: dict) -> str | None:
        """What the command prints for a ``result`` that is not a dataset's report (None: it is
        one, printed as such)."""
        return None


UNIT_MB = Flag(
    "--unit-mb",
    "unit_bytes",
    "input per unit of the ray and slurm executors (MiB, default 256); a file is cut at line ends",
    type=float,
    default=256.0,
    convert=lambda mib: max(1, int(mib * (1 << 20))),
)


class UnitExecutor(Executor):
    """An executor of units: the inputs cut by :func:`plan_units`, each unit tokenized on its own
    into a staging directory beside the output, the units merged in order
    (:mod:`data_prep.units`)."""

    flags: ClassVar[tuple[Flag, ...]] = (UNIT_MB,)

    def writes(self, cfg: PrepConfig) -> list[tuple[str, str | Path | None]]:
        """Its outputs besides the dataset's, as ``(flag, path)``."""
        return [("--output-prefix", staging_path(cfg.output_prefix))]

    def refuse(self, cfg: PrepConfig) -> None:
        """Refuse its own flags where they cannot work, before the tokenizer is loaded (seconds)."""

    def run(self, cfg: PrepConfig) -> dict:
        t_start = time.perf_counter()
        sources, tok_fp = checked_inputs(cfg, self.writes(cfg))
        if cfg.unit_bytes < 1:
            raise PortingError(f"--unit-mb {cfg.unit_bytes / (1 << 20)}: need a positive size")
        self.refuse(cfg)
        with output_lock(cfg.output_prefix, "dataset"):
            refuse_existing(cfg)
            return self.run_units(cfg, sources, tok_fp, t_start)

    @abstractmethod
    def run_units(
        self, cfg: PrepConfig, sources: list[Source], tok_fp: str, t_start: float
    ) -> dict:
        """Plan the job (:func:`data_prep.units.plan_job`), then tokenize its units or hand them
        out; the output's lock is held."""
