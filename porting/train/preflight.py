"""Every check of a ``porting train`` run that can be made before a process is launched, in
order, for either engine: :func:`preflight` (NeMo 2) and :func:`preflight_bridge`
(Megatron-Bridge) read the checkpoint and build the model's config (no trainer, no model), then
run the checks of :mod:`porting.train.checks` (the layout, batch and data, the run directory, a
resume at another layout) and of :mod:`porting.train.plan_check` (a plan). The launchers call
them in the launching process, so a bad run fails before a rank starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from porting.errors import PortingError
from porting.train.checks import (
    TrainSpec,
    check_bridge_layout_change,
    check_layout_change,
    check_run_dir,
    check_same_model,
    validate,
)
from porting.train.plan_check import check_plan


@dataclass
class Preflight:
    """What :func:`preflight` read and found: the manifest, the model's config, warnings."""

    manifest: object
    family: object
    config: object
    warnings: list[str]


def check_memory(spec: TrainSpec, weights: Path | None = None) -> None:
    """On the CPU, refuse a run whose ranks on this node cannot hold even their share of the
    model's fp32 weights and gradients (8 bytes a parameter; Adam's states and activations come on
    top): it would be killed by the out-of-memory killer minutes in. The parameter count comes
    from the checkpoint's ``.metadata``; on GPUs the planner (`porting plan`) is the check."""
    import torch

    from porting.convert.dist_reader import DistCheckpointReader
    from porting.convert.preflight import available_bytes, size

    if torch.cuda.is_available():
        return
    reader = DistCheckpointReader(weights or Path(spec.checkpoint) / "weights")
    # NeMo 2 names the model's weights "module.*"; Megatron-Bridge's iterations hold them
    # unprefixed, beside "optimizer.*" and "rng_state" of a trained one.
    prefix = "module." if weights is None else ""
    params = sum(
        math.prod(reader.global_shape(k))
        for k in reader.keys()
        if k.startswith(prefix) and not k.startswith(("optimizer.", "rng_state"))
    )
    ranks = spec.gpus_per_node
    need = params * 8 * ranks // (spec.tp * spec.pp)
    have = available_bytes()
    if need > have:
        raise PortingError(
            f"--checkpoint {spec.checkpoint}: {params / 1e9:.2f}B parameters need at least "
            f"{size(need)} on this node for fp32 weights and gradients alone ({ranks} rank(s), "
            f"each 1/{spec.tp * spec.pp} of the model); it has {size(have)} free. Train on GPUs, "
            "or on more nodes with a larger --tp / --pp"
        )


def preflight(spec: TrainSpec, nemo: bool = True) -> Preflight:
    """Every check that can be made before a process is launched (no trainer, no model built).

    The checkpoint's manifest and ``io.json`` files, the layout, batch and data against the model
    (:func:`validate`), the run directory's checkpoints (:func:`check_run_dir`), a resume at another
    layout (:func:`check_layout_change`) and a plan (:func:`check_plan`). Raises
    :class:`PortingError` naming the file and field; returns the warnings. ``nemo``: the config
    is NeMo's class (the model a rank trains); otherwise the family's NeMo-free twin of it
    (``Family.core_config_cls``, the same fields and model: tests/test_mcore.py), so a launcher
    that only checks never loads NeMo.
    """
    from porting.convert.context import check_io_json
    from porting.convert.megatron import checkpoint_config

    checkpoint, family = _engine_checkpoint(
        spec,
        "nemo2",
        "--engine nemo2 trains a NeMo 2 one: train it with --engine bridge (the current "
        f"stack), or convert it first with `porting convert {spec.checkpoint} --to nemo2 "
        "--out DIR`",
    )
    manifest = checkpoint.manifest
    # NeMo reads io.json of the restored checkpoint and of every checkpoint it may resume from
    # (artifacts, the tokenizer); each is checked before NeMo sees it. The model itself is built
    # from our manifest.
    check_io_json(spec.checkpoint, family)
    for resumable in sorted((Path(spec.out) / "checkpoints").glob("*/context")):
        check_io_json(resumable.parent, family)
    config = checkpoint_config(checkpoint, family, nemo=nemo)
    check_memory(spec)
    check_run_dir(spec, manifest, config)
    return _checked(spec, manifest, family, config, check_layout_change)


def _engine_checkpoint(spec: TrainSpec, layout: str, wanted: str):
    """The checkpoint ``--checkpoint`` names and its family, refused unless it is in ``layout``
    (``wanted``: the engine, the layout it trains, and how to get one)."""
    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(spec.checkpoint)
    if checkpoint.located.format != layout:
        raise PortingError(
            f"--checkpoint {spec.checkpoint}: a {checkpoint.located.format} checkpoint, and {wanted}"
        )
    return checkpoint, family_by_name(checkpoint.family)


def preflight_bridge(spec: TrainSpec) -> Preflight:
    """:func:`preflight` for the Megatron-Bridge engine: ``--checkpoint`` must be a
    Megatron-Bridge checkpoint of ours (`porting import --format megatron-bridge`, or `porting
    convert --to megatron-bridge`), and the run directory's checkpoints (a Bridge root,
    ``OUT/checkpoints``) must be of its model."""
    from porting.convert.megatron import checkpoint_config

    checkpoint, family = _engine_checkpoint(
        spec,
        "megatron-bridge",
        "--engine bridge trains a Megatron-Bridge one: convert it first with `porting convert "
        f"{spec.checkpoint} --to megatron-bridge --out DIR` (or train it with --engine nemo2, "
        "in the nemo2 environment)",
    )
    if Path(spec.checkpoint).resolve() != checkpoint.located.root.resolve():
        raise PortingError(
            f"--checkpoint {spec.checkpoint}: give the checkpoint's root "
            f"({checkpoint.located.root}), not one of its iterations"
        )
    manifest = checkpoint.manifest
    config = checkpoint_config(checkpoint, family, nemo=False)
    check_memory(spec, checkpoint.located.weights)
    ours = Path(spec.out) / "checkpoints" / "porting" / "porting.json"
    if ours.is_file():
        check_same_model(ours, ours.parent.parent, spec, manifest, checkpoint.located.manifest_path)
    return _checked(spec, manifest, family, config, check_bridge_layout_change)


def _checked(spec: TrainSpec, manifest, family, config, layout_change) -> Preflight:
    """The checks both engines make once the model's config is built: the layout, batch and
    data, a plan, and a resume at another layout (``layout_change``: the engine's own reading of
    what its checkpoints were saved at), whose note joins the warnings."""
    warnings = validate(spec, config, manifest.vocab_size)
    if spec.plan is not None:
        check_plan(spec, manifest, config)
    note = layout_change(spec)
    if note:
        warnings.append(note)
    return Preflight(manifest, family, config, warnings)
