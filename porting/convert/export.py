"""Export: one of our checkpoints (any layout) to an HF directory, streamed, without NeMo.

The Megatron model is built on the meta device from the family's NeMo-free config
(:func:`porting.convert.megatron.checkpoint_config`), so an export loads Megatron-Core and torch,
never NeMo or Lightning; NeMo's ``llm.export_ckpt`` reaches the same function through
:class:`porting.convert.connectors.PortingExporter`.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
from pathlib import Path

import torch

from porting.contract import config_map, hf_spelling
from porting.contract.family import Family
from porting.contract.mapping import stacked_part, stored_key
from porting.convert import ranks
from porting.convert.checkpoint import Checkpoint, extra_file, tokenizer_files
from porting.convert.dist_reader import CheckpointParameters, DistCheckpointReader
from porting.convert.layouts import check_saved_metadata
from porting.convert.manifest import Manifest
from porting.convert.mapping import export_owners, export_weights
from porting.convert.megatron import DTYPES, build_mcore_model, checkpoint_config, init_parallel
from porting.convert.preflight import check_nemo_layout
from porting.convert.safetensors_io import StreamingShardWriter
from porting.convert.table_check import check_table, hf_meta_shapes
from porting.errors import PortingError


def shapes_of(params: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a state dict, for the table check."""
    return {k: tuple(v.shape) for k, v in params.items()}


HF_LAYOUTS = ("as-imported", "published", "stacked")


def resolved_hf_layout(hf_layout: str, manifest: Manifest) -> str:
    """``published`` or ``stacked``: what ``hf_layout`` asks of this checkpoint's export."""
    if hf_layout not in HF_LAYOUTS:
        raise PortingError(f"--hf-layout must be one of {', '.join(HF_LAYOUTS)}, not {hf_layout!r}")
    if hf_layout == "as-imported":
        return manifest.hf_experts or "published"
    return hf_layout


def _hf_layout(hf_layout: str, manifest: Manifest, specs: list, where: str):
    """The stored tensors for ``hf_layout`` and the parts written into them (None: each tensor
    is stored as itself)."""
    if resolved_hf_layout(hf_layout, manifest) == "published":
        return specs, None
    from porting.convert.packed_experts import stacked_plan

    stored, parts = stacked_plan(manifest.hf_config.get("model_type"), specs, where)
    shapes = {key: shape for key, shape, _ in specs}
    return stored, {key: (into, at, shapes[key]) for key, (into, at) in parts.items()}


def export_into(
    checkpoint: Checkpoint,
    out: Path,
    family: Family,
    max_shard_bytes: int = 5 * 2**30,
    hf_layout: str = "as-imported",
) -> Manifest:
    """Write the HF directory for our ``checkpoint`` (any layout) of ``family`` into ``out``.

    ``hf_layout``: a mixture of experts' tensors one per expert under their published names
    (``published``), or each layer's experts stacked as transformers 5 stores them with
    ``save_original_format=False`` (``stacked``); ``as-imported`` (the default) writes the form
    the source came in.

    Streamed: the Megatron model is built on the meta device from the manifest (its layout says
    where each parameter lives), each parameter is read from ``weights/`` when the table reaches
    it, run backwards through the table, cast to the import dtype and written into its place in
    the planned safetensors shards. One parameter and its HF tensors are in memory at a time.
    """
    manifest = checkpoint.manifest
    # Not read here, but a checkpoint whose metadata would run code on load is hostile.
    check_saved_metadata(checkpoint, family)
    if manifest.family != family.name:
        raise PortingError(
            f"{checkpoint.path}: a {manifest.family!r} checkpoint, not one of family "
            f"{family.name!r}"
        )
    config, model, ctx, meta = _meta_model(checkpoint, family)
    # Training keeps fp32 master weights; HF gets the import dtype, and the tensors the source
    # stored in float32 beside them (the manifest's fp32_tensors) float32 again.
    fp32 = frozenset(manifest.fp32_tensors)

    def dtype_of(key: str) -> torch.dtype:
        return torch.float32 if key in fp32 else DTYPES[manifest.dtype]

    # The transforms run on meta tensors first: every HF tensor's name, shape and dtype, before
    # any data, so the shards and their headers are planned up front.
    specs = [
        (key, tuple(t.shape), dtype_of(key))
        for key, t in export_weights(meta, family.weights, ctx, ctx.num_layers)
    ]
    # A stacked HF tensor (Llama 4's, gpt-oss's experts) is written a slice at a time into its
    # place, never made whole: a Scout layer's stack is 2.7 GB, and its slices as many again.
    slices = {}
    for key, t in export_weights(meta, family.weights, ctx, ctx.num_layers, stack=False):
        if (part := stacked_part(key)) is not None:
            slices[key] = (part[0], part[1] * t.numel(), tuple(t.shape))
    # A launched export: each rank makes and writes its share of the tensors into the planned
    # files (porting.convert.ranks), rank 0 made them first and names them once all are done.
    world, rank = ranks.world_size(), ranks.rank()
    keep = None
    if world > 1:
        sizes = {key: math.prod(shape) * dtype.itemsize for key, shape, dtype in specs}
        owner = export_owners(family.weights, ctx, ctx.num_layers, meta, sizes, world)
        keep = lambda key: owner[key] == rank  # noqa: E731
    stored, parts = _hf_layout(hf_layout, manifest, specs, str(checkpoint.path))
    mine = None if keep is None else {k for k in owner if keep(k)}
    if slices:
        parts = {**(parts or {}), **slices}
        if mine is not None:
            mine |= {key for key, (into, _, _) in slices.items() if into in mine}
    held = _container(checkpoint, family)
    if held is not None:  # the language model under the names it came with, beside the rest
        stored, parts, mine = held.renamed(stored, parts, mine, rank == 0)
    writer = StreamingShardWriter(
        out, stored, max_shard_bytes, mine=mine, create=rank == 0, parts=parts,
    )  # fmt: skip
    if world > 1:
        torch.distributed.barrier()  # the files exist, at their sizes, before any rank writes
    _stream_weights(checkpoint, model, meta, family, ctx, writer, keep, dtype_of, held)
    if held is not None and rank == 0:
        held.write_carried(writer)
    writer.finish()
    if world > 1:
        torch.distributed.barrier()
    if rank != 0:
        return manifest
    writer.publish()
    del model, meta
    gc.collect()
    _write_config_and_files(checkpoint, config, family, out)
    return manifest


def _meta_model(checkpoint: Checkpoint, family: Family):
    """``(config, model, shape context, parameters)`` of the checkpoint's Megatron model built on
    the meta device, its vocabulary and table checked against the manifest's HF model."""
    from accelerate import init_empty_weights

    manifest = checkpoint.manifest
    init_parallel()
    config = checkpoint_config(checkpoint, family)
    with init_empty_weights():
        model = build_mcore_model(config)
    ctx = family.shape_context(config, manifest.vocab_size)
    if ctx.padded_vocab_size != manifest.padded_vocab_size:
        raise PortingError(
            f"{checkpoint.path}: model vocabulary {ctx.padded_vocab_size} differs from the "
            f"manifest's padded vocabulary {manifest.padded_vocab_size}"
        )
    meta = {
        k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")
    }
    check_table(family, ctx, hf_meta_shapes(family, manifest.hf_config), shapes_of(meta))
    return config, model, ctx, meta


def _stream_weights(
    checkpoint: Checkpoint, model, meta, family: Family, ctx, writer, keep, dtype_of, held=None
):
    """Each parameter read from the checkpoint's weights as the table reaches it, run backwards
    through the table and written into its planned place (this rank's share: ``keep``)."""
    loc = checkpoint.located
    reader = DistCheckpointReader(loc.weights)
    sharded = model.sharded_state_dict(prefix=loc.prefix)
    check_nemo_layout(sharded, reader, str(loc.manifest_path))
    params = CheckpointParameters(reader, sharded, meta, loc.prefix)
    name = held.stored_name if held is not None else (lambda key: key)
    for key, tensor in export_weights(
        params, family.weights, ctx, ctx.num_layers, keep, stack=False
    ):
        writer.write(name(key), tensor.to(dtype_of(stored_key(key))))
        del tensor


def _container(checkpoint: Checkpoint, family: Family):
    """The container a checkpoint's language model came in (its manifest's, checked against
    the family), ready to write it back; None for any other checkpoint."""
    from porting.convert.container import ExportedContainer

    recorded = checkpoint.manifest.container
    if recorded is None:
        return None
    return ExportedContainer.of(checkpoint, family, recorded)


def _write_config_and_files(checkpoint: Checkpoint, config, family: Family, out: Path) -> None:
    """``config.json`` as the source wrote it (its spelling, its declared MTP count), the
    tokenizer's files and the files carried beside the weights."""
    manifest = checkpoint.manifest
    written = manifest.hf_config_as_written
    hf_config = hf_spelling.as_written(
        config_map.to_hf(config, manifest.hf_config, family.config_entries),
        written,
        str(checkpoint.located.manifest_path),
    )
    count = family.mtp_count
    if count and written and written.get(count) and manifest.hf_config.get(count) == 0:
        # the MTP layers it declared were never stored (hf_import.prepare): the count as it came
        hf_config[count] = written[count]
    held = manifest.container
    if held is not None:  # the language model's config in its place in the container's
        from porting.convert.container import container_config, of_manifest

        where = str(checkpoint.located.manifest_path)
        container, _ = of_manifest(family, held, where)
        hf_config = container_config(
            held["config"], container, hf_config, manifest.hf_config, where
        )
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for f in tokenizer_files(checkpoint):
        shutil.copyfile(f, out / f.name)
    for name in manifest.extra_files:
        shutil.copyfile(extra_file(checkpoint, name), out / name)
