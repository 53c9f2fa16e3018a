"""The conversion entry points the CLI, the demo and tests call: import and export, each written
atomically and, unless told otherwise, held back until the parity gate passes.

The family comes from the registry (``config.json``'s architecture on import, the manifest's family
on export); the gate is :mod:`porting.parity`'s check, run on the finished temporary directory
before it is renamed into place.
"""

from __future__ import annotations

import logging
from pathlib import Path

from porting.contract.registry import family_by_name
from porting.convert.checkpoint import (
    Checkpoint,
    claimed_output,
    open_checkpoint,
    prepare_output,
    remove_stale,
    staged,
)
from porting.convert.container import reference_architecture
from porting.convert.export import export_into, resolved_hf_layout
from porting.convert.hf_files import HFSource, open_hf
from porting.convert.layouts.registry import is_hf_dir, layout_named
from porting.errors import PortingError
from porting.guard import output_lock, refuse_overlap

log = logging.getLogger(__name__)


def import_hf(
    hf_dir: HFSource | str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    dtype: str | None = None,
    allow_pickle: bool = False,
    vocab_divisor: int = 128,
    verify: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    whole_model: bool = False,
    show_progress: bool = True,
    family: str | None = None,
    device: str = "cpu",
    fmt: str = "nemo2",
):
    """Import an HF directory into a checkpoint at ``out``; gate it on parity.

    ``fmt``: the layout written, one of :data:`porting.convert.layouts.registry.NAMES` (NeMo 2 by
    default; Megatron-LM's or Megatron-Bridge's ``iter_0000000/``). ``family`` picks an installed family by name where more than one could read the checkpoint
    (it must still claim the config's architecture or model type). ``device``: where the
    gate's layers compute (:func:`porting.parity.harness.verify`).
    Returns the parity report (``None`` with ``verify=False``). On a failed parity check the
    checkpoint is not left under ``out`` and :class:`PortingError` is raised with the report.
    """

    from porting.convert import ranks

    hf = open_hf(hf_dir, family)  # the directory's config is read here, once
    refuse_overlap(out, [("HF directory", hf.path)])
    layout = layout_named(fmt)
    family = hf.family
    options = dict(
        dtype=dtype,
        allow_pickle=allow_pickle,
        vocab_divisor=vocab_divisor,
        show_progress=show_progress,
        gate=("whole" if whole_model else "streamed") if verify and device == "cpu" else None,
    )

    # a model the layout cannot describe is refused before any tensor is read
    from porting.convert.megatron import DTYPES, build_config

    config, _ = build_config(family, hf.config, DTYPES["float32"], vocab_divisor)
    layout.check_config(config, family)

    def into(tmp: Path):
        manifest = nemo2_import(hf, tmp, family, **options)
        if manifest is not None:  # rank 0 of a launched import, or the one process
            layout.write(tmp, _layout_config(family, manifest, vocab_divisor), manifest, family)
        if ranks.world_size() > 1:
            import torch

            torch.distributed.barrier()  # the layout's files are there before any rank reads
        if verify:
            return _gate(hf, tmp, tmp, atol, rtol, whole_model, show_progress, device, allow_pickle)
        return None

    return _written(out, overwrite, "checkpoint", into)


def nemo2_import(hf: HFSource, tmp: Path, family, **options):
    """The NeMo 2 checkpoint of ``hf`` in the empty directory ``tmp``, no gate: written
    without NeMo where the family has a NeMo-free config (:mod:`porting.convert.hf_import`),
    else by its NeMo importer. ``options``: ``import_into``'s. Returns the manifest (``None`` on
    a launched import's ranks but rank 0)."""
    if family.core_config_cls is not None:
        from porting.convert.hf_import import import_into

        return import_into(hf, tmp, family, **options)
    hf_dir = hf.path.resolve()
    from porting import quiet
    from porting.convert.connectors import model_class

    quiet.quiet_nemo()
    importer = model_class(family).importer(f"hf://{hf_dir}")
    for name, value in options.items():
        setattr(importer, name, value)
    return importer.convert_into(tmp)


def _written(out, overwrite: bool, what: str, into):
    """``into(directory)`` on a temporary directory that becomes ``out`` if it succeeds; a rank
    of a launched conversion (``--executor torchrun|slurm``) writes into the staging directory
    its launcher claimed instead, and the launcher moves it into place (porting.convert.ranks)."""
    from porting.convert import ranks

    staging = ranks.staging()
    if staging is not None:
        return into(staging)
    with claimed_output(out, overwrite, what) as tmp:
        return into(tmp)


def export_hf(
    ckpt: Checkpoint | str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    verify: bool = True,
    max_shard_bytes: int = 5 * 2**30,
    whole_model: bool = False,
    show_progress: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    device: str = "cpu",
    quantize: str | None = None,
    hf_layout: str = "as-imported",
):
    """Export our checkpoint (in any layout; a path is opened here) to an HF directory at
    ``out``; gate it on parity. ``hf_layout``: a mixture of experts' tensors as the import read
    them, one per expert (``published``) or stacked as transformers 5 stores them (``stacked``;
    :func:`porting.convert.export.export_into`).

    Returns the parity report (``None`` with ``verify=False``). ``atol``, ``rtol``, ``device``:
    the gate's (:func:`porting.parity.harness.verify`). The weights are written in the
    checkpoint's dtype (bf16 for an imported quantized release, whose ``quantization_config`` is
    then dropped, saying so); ``quantize="fp8-block"`` writes FP8 with 128x128 block scales and
    the ``quantization_config`` transformers reads, after the gate passed on the unquantized
    export (FP8's rounding is no conversion error).
    """

    if quantize not in (None, FP8_BLOCK):
        raise PortingError(f"--quantize must be {FP8_BLOCK}, not {quantize!r}")
    from porting.convert import ranks

    given = ckpt.path if isinstance(ckpt, Checkpoint) else ckpt
    refuse_overlap(out, [("checkpoint", given)])
    first = ranks.rank() == 0

    def into(tmp: Path):
        report = None
        checkpoint = open_checkpoint(ckpt)
        family = family_by_name(checkpoint.family)
        if quantize and resolved_hf_layout(hf_layout, checkpoint.manifest) == "stacked":
            # FP8 releases store their experts one tensor each, with a scale per block of each
            raise PortingError(
                f"--quantize {quantize} writes experts one tensor each, as FP8 releases do; "
                "add --hf-layout published"
            )
        export_into(checkpoint, tmp, family, max_shard_bytes, hf_layout)
        released = None  # the FP8 release's config.json as it came, for --quantize to write back
        if first:
            released = _unquantized_config(tmp, checkpoint.manifest.dtype)
        if ranks.world_size() > 1:
            import torch

            torch.distributed.barrier()  # the whole directory is there before any rank reads
        if verify:
            report = _gate(tmp, checkpoint, tmp, atol, rtol, whole_model, show_progress, device)
        if quantize == FP8_BLOCK and first:
            from porting.convert.quant_export import quantize_export

            hf_class = family.hf_class(reference_architecture(checkpoint.manifest))
            n = quantize_export(tmp, hf_class, max_shard_bytes, released=released)
            log.info(
                "%s: %d weights written as FP8 in 128x128 blocks (quantization_config fp8)", out, n
            )
        return report

    return _written(out, overwrite, "HF directory", into)


FP8_BLOCK = "fp8-block"


def _unquantized_config(hf_dir: Path, dtype: str) -> dict | None:
    """Drop a quantization_config the source release had from the export's ``config.json``: the
    weights just written are unquantized, and transformers would read them as quantized. Returns
    the config as it was where that release was FP8 (``--quantize fp8-block`` writes it back)."""
    import json

    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    released = None
    if "quantization_config" in config:
        qc = config["quantization_config"]
        if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
            released = json.loads(json.dumps(config))
        method = config.pop("quantization_config").get("quant_method")
        path.write_text(json.dumps(config, indent=2) + "\n")
        log.info(
            "config.json: the source's quantization_config (%s) is not written: the weights are "
            "%s (--quantize fp8-block writes FP8)",
            method,
            dtype,
        )
    return released


def _gate(
    hf_dir, ckpt, scratch, atol, rtol, whole_model, show_progress, device, allow_pickle=False
):
    """The parity gate on a finished temporary output (its hidden states wait in ``scratch``, so
    that a killed run leaves them with it); a failure raises :class:`ParityError`."""
    from porting.parity import harness as parity

    report = parity.verify(
        hf_dir,
        ckpt,
        atol=parity.DEFAULT_ATOL if atol is None else atol,
        rtol=parity.DEFAULT_RTOL if rtol is None else rtol,
        whole_model=whole_model,
        show_progress=show_progress,
        allow_pickle=allow_pickle,
        scratch_dir=scratch,
        device=device,
    )
    if not report.passed:
        raise ParityError(report)
    return report


class ParityError(PortingError):
    """The parity gate failed; carries the report."""

    def __init__(self, report) -> None:
        super().__init__("parity check failed; no output written\n" + report.summary())
        self.report = report


def convert(
    src: str | Path,
    out: str | Path,
    to: str,
    *,
    overwrite: bool = False,
    verify: bool = True,
    show_progress: bool = False,
    device: str = "cpu",
    atol: float | None = None,
    rtol: float | None = None,
):
    """Convert ``src`` (an HF directory or a checkpoint in any of our layouts) into the layout
    ``to`` at ``out``; returns the parity reports (one per gated step).

    From an HF directory this is :func:`import_hf`. Between checkpoints it is the export of
    ``src`` to an HF directory in a private sibling of ``out``, then the import of that into
    ``to``: each step streamed and gated as on its own, so memory stays that of one tensor and one
    layer, and the HF round trip is exact. A checkpoint trained elsewhere is read as the caller
    adopted it (:func:`porting.convert.foreign.reading`). Optimizer and train state are not
    carried (docs/formats.md).
    """
    from porting.convert.megatron import padded_vocab

    layout_named(to)  # an unknown layout is refused before anything is read
    gate = dict(verify=verify, show_progress=show_progress, device=device, atol=atol, rtol=rtol)
    if is_hf_dir(src):
        return [import_hf(src, out, overwrite=overwrite, fmt=to, **gate)]
    refuse_overlap(out, [("checkpoint", src)])
    checkpoint = open_checkpoint(src)
    manifest = checkpoint.manifest
    # Keep the source's vocabulary padding: Megatron's default divisor where it gives it, else
    # the padded size itself (a run with TP > 1 pads to 128 * TP).
    divisor = 128
    if padded_vocab(manifest.vocab_size, divisor) != manifest.padded_vocab_size:
        divisor = manifest.padded_vocab_size
    # Both steps under the output's lock: the HF copy between them is then this run's alone, and
    # what a killed run left (that copy included) is removed before another is made.
    with output_lock(out, "checkpoint"):
        prepare_output(out, overwrite)
        remove_stale(out)
        with staged(out, "hf") as staging:
            hf = staging / "hf"
            first = export_hf(checkpoint, hf, **gate)
            second = import_hf(
                hf,
                out,
                overwrite=overwrite,
                fmt=to,
                dtype=checkpoint.dtype,
                vocab_divisor=divisor,
                **gate,
            )
    return [r for r in (first, second) if r is not None]


def _layout_config(family, manifest, vocab_divisor: int):
    """The family's Megatron config of the checkpoint just imported with ``manifest``: what a
    layout writes beside the tensors (Megatron-LM's saved arguments, Bridge's provider)."""
    from porting.convert.megatron import DTYPES, build_config

    config, _ = build_config(
        family,
        manifest.hf_config,
        DTYPES[manifest.dtype],
        vocab_divisor,
        padded_vocab_size=manifest.padded_vocab_size,
    )
    return config
