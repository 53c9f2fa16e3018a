"""HF -> NeMo 2 checkpoint, streamed tensor by tensor, without NeMo.

What NeMo's importer does for a conversion (``nemo/lightning/io/connector.py``: ``nemo_setup``,
``nemo_save``) is a Megatron-Core model built for its shapes, ``dist_checkpointing.save`` of its
sharded state dict under the ``module.`` prefix beside Lightning's trainer state, and the model's
recorded context. Here the model is built from the family's NeMo-free config, the tensors are
streamed into Megatron's own save (:mod:`porting.convert.streaming_save`), and the context and
trainer state are written as data (:mod:`porting.convert.nemo2_context`): the same files, with no
NeMo or Lightning start-up (10-15 s of a conversion's CPU). :class:`PortingImporter`
(``llm.import_ckpt``, :mod:`porting.convert.connectors`) writes through this too.
"""

from __future__ import annotations

import gc
import logging
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from porting.contract import config_map
from porting.contract.family import Family, ShapeContext
from porting.convert import container, hf_files, nemo2_context, ranks, streaming_save
from porting.convert.export import shapes_of
from porting.convert.hf_files import HFSource, open_hf
from porting.convert.manifest import EXTRA_HF_FILES, Manifest, write_manifest
from porting.convert.mapping import WeightProducer
from porting.convert.megatron import DTYPES, config_arguments, dtype_name
from porting.convert.preflight import (
    as_stored,
    check_float_dtypes,
    check_gate_memory,
    check_hf_checkpoint,
)
from porting.convert.safetensors_io import SafetensorsSource, hf_weights
from porting.convert.table_check import check_table
from porting.errors import PortingError

log = logging.getLogger(__name__)

TOKENIZER_SUBDIR = f"context/{nemo2_context.TOKENIZER_DIR}"


def resolve_dtype(source: SafetensorsSource, requested: str | None, family: Family) -> torch.dtype:
    """The weight dtype of the import: the checkpoint's own unless the user asks for another.

    A checkpoint mixing floating dtypes is refused without an explicit ``--dtype``: picking one
    would silently change some tensors. The family's ``fp32_tensors`` do not vote: a release keeps
    them in float32 beside weights of another dtype, and so does the import.
    """
    if requested is not None:
        if requested not in DTYPES:
            raise PortingError(f"--dtype must be one of {', '.join(DTYPES)}, not {requested!r}")
        return DTYPES[requested]
    found = source.dtypes(skip=family.keeps_fp32)
    if len(found) != 1:
        names = ", ".join(sorted(dtype_name(d) for d in found)) or "none"
        raise PortingError(
            f"{source.dir}: weights mix dtypes ({names}); pass --dtype to choose the import dtype"
        )
    return found.pop()


def kept_fp32(source: SafetensorsSource, family: Family) -> list[str]:
    """The HF tensors of ``source`` that ``family`` declares ``fp32_tensors`` and that are stored
    as float32: never cast on import, written back as F32 on export (the manifest lists them)."""
    return sorted(
        k for k in source.keys() if family.keeps_fp32(k) and source.stored_dtype(k)[0] == "F32"
    )


class _CastingSource:
    """A tensor source that casts to the import dtype; used only when the user chose ``--dtype``.
    The ``keep`` tensors stay as stored (the family's float32 ones)."""

    def __init__(self, inner: SafetensorsSource, dtype: torch.dtype, keep: frozenset[str]) -> None:
        self.inner, self.dtype, self.keep = inner, dtype, keep

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get(self, key: str) -> torch.Tensor:
        return self._cast(key, self.inner.get(key))

    def expert(self, key: str, index: int) -> torch.Tensor:
        return self._cast(key, self.inner.expert(key, index))

    def _cast(self, key: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() and key not in self.keep else t


@dataclass
class Prepared:
    """An HF checkpoint checked against its family, before any model exists."""

    family: Family
    hf_dir: Path
    hf_config: dict
    # the file as it came where hf_config differs from it: transformers 5's spelling, or an MTP
    # count read as 0 (Family.mtp_count)
    hf_config_as_written: dict | None
    source: SafetensorsSource
    dtype: torch.dtype
    fp32: list[str]
    reader: object  # the source, or a casting view of it under --dtype
    kwargs: dict  # the Megatron config's arguments (porting.convert.megatron.config_arguments)
    ctx: ShapeContext
    hf_shapes: dict


def prepare(
    hf: HFSource | Path,
    family: Family,
    source: SafetensorsSource,
    *,
    dtype: str | None = None,
    vocab_divisor: int = 128,
    gate: str | None = None,
) -> Prepared:
    """What an import checks before it builds a model: the architecture is the family's, the
    weights' dtypes, the config against the headers (a config that lies about its size is refused
    before anything is built), and the gate's memory (``gate``: ``"streamed"`` / ``"whole"``)."""
    hf = open_hf(hf, family.name)
    hf_dir, hf_config = hf.path, hf.config
    if not family.claims(hf_config):
        raise PortingError(
            f"{hf_dir}/config.json: architecture {hf_config['architectures'][0]!r} is not "
            f"one of family {family.name}'s ({', '.join(family.keys)})"
        )
    where = str(hf_dir / "config.json")
    check_float_dtypes(family, source)
    weight_dtype = resolve_dtype(source, dtype, family)
    fp32 = kept_fp32(source, family)
    reader = _CastingSource(source, weight_dtype, frozenset(fp32)) if dtype else source

    def shape_of(cfg: dict) -> ShapeContext:
        config = family.config_class(nemo=False)(
            **config_arguments(family, cfg, weight_dtype, vocab_divisor)
        )
        return family.shape_context(config, cfg["vocab_size"])

    # the model has no MTP block where none is stored; the gate compares the decoder's logits
    mapped, declared = as_stored(family, hf_config, source.keys(), shape_of)
    kwargs = config_arguments(family, mapped, weight_dtype, vocab_divisor)
    config = family.config_class(nemo=False)(**kwargs)
    ctx = family.shape_context(config, hf_config["vocab_size"])
    if declared is not None:
        log.info(
            f"{where}: {family.mtp_count}={declared!r}, and no multi-token-prediction layer is "
            f"stored after layer {ctx.num_layers - 1} (transformers writes the count, never the "
            "layer): the decoder alone is imported"
        )
    for line in config_map.notes(mapped, family.config_entries, where):
        log.info(line)
    hf_shapes = check_hf_checkpoint(family, mapped, ctx, source, hf_dir / "config.json", "import")
    if gate is not None:
        check_gate_memory("import", hf_shapes, hf_config, whole_model=gate == "whole")
    # The checkpoint's Megatron config is the manifest's hf_config read again, so it holds the
    # count as read (0); the file as it came is kept beside it, for export to write back.
    written = hf.as_written if declared is None else (hf.as_written or hf_config)
    return Prepared(
        family, hf_dir, mapped, written, source, weight_dtype, fp32, reader, kwargs, ctx,
        hf_shapes,
    )  # fmt: skip


def _progress(show: bool):
    return (lambda n: tqdm(total=n, desc="import", unit="tensor", leave=False)) if show else None


def import_into(
    hf_dir: HFSource | str | Path,
    out: str | Path,
    family: Family,
    *,
    dtype: str | None = None,
    allow_pickle: bool = False,
    vocab_divisor: int = 128,
    show_progress: bool = True,
    gate: str | None = None,
) -> Manifest | None:
    """Stream the HF weights of ``hf_dir`` through the family table into a NeMo 2 checkpoint at
    ``out`` (an existing, empty directory). Returns the manifest written (``None`` on the ranks
    of a launched import other than rank 0, which writes the context and our files).

    ``dtype``: None = the checkpoint's; ``gate``: the parity gate that follows (its memory is
    checked before anything is written). Peak memory is one produced tensor and its sources.
    """
    if family.core_config_cls is None:
        raise PortingError(
            f"family {family.name} ({family.source}) has no core_config_cls: its NeMo 2 "
            "checkpoint is written through NeMo (porting.convert.connectors)"
        )
    from megatron.core import dist_checkpointing

    from porting.convert.megatron import build_mcore_model, init_parallel, shutdown_parallel

    hf = open_hf(hf_dir, family.name)
    hf_dir, out = hf.path, Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = hf_weights(hf, allow_pickle=allow_pickle)
    prep = prepare(hf, family, source, dtype=dtype, vocab_divisor=vocab_divisor, gate=gate)
    ranked = ranks.world_size() > 1
    init_parallel()  # one process, or the launched ranks' world as data-parallel replicas
    model = build_mcore_model(family.config_class(nemo=False)(**prep.kwargs))
    # The local spec builds norms in fp32 whatever params_dtype says (torch.nn norms); NeMo's
    # bf16 training wraps the whole module in half precision, so store every tensor in the
    # checkpoint's dtype, as the source has it (NeMo's own importer fails exactly here).
    model.to(prep.dtype)
    target = {
        k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")
    }
    # The table against both models of this config, on meta tensors, before any tensor is read.
    check_table(family, prep.ctx, prep.hf_shapes, shapes_of(target))
    producer = WeightProducer(
        prep.reader, target, family.weights, prep.ctx, prep.ctx.num_layers, _progress(show_progress)
    )
    del target
    _save_weights(out / "weights", model, producer, ranked, dist_checkpointing)
    if ranked:  # each rank made its share; together they must have made every one
        everyone: list = [None] * ranks.world_size()
        torch.distributed.all_gather_object(everyone, producer.produced)
        producer.produced = set().union(*everyone)
    report = producer.finish()
    method, count = source.dequantized() or ("", 0)
    source.close()
    del model, producer
    if not ranked:  # a launched import's process group stays for the layout and the gate
        shutdown_parallel()
    gc.collect()
    manifest = None
    if ranks.rank() == 0:
        nemo2_context.write_context(out, family, prep.kwargs)
        hf_files.load_tokenizer(hf_dir, hf.raw_config).save_pretrained(str(out / TOKENIZER_SUBDIR))
        held = None
        if hf.container is not None:  # what is not the language model, carried as stored
            carried = container.write_carried(
                source, container.carried_dir(out / "context"), allow_pickle
            )
            held = container.record(hf.container, source)
            log.info(
                "%s is a %s: its language model is converted, %d other tensor(s) carried as "
                "stored (%s)%s",
                hf_dir, hf.container.container.architecture, carried,
                ", ".join(sorted({k.split(".")[0] for k in source.carried})),
                container.unapplied_note(hf.container),
            )  # fmt: skip
        manifest = write_extras(out, prep, held)
    if ranked:
        torch.distributed.barrier()
    if manifest is None:
        return None
    log.info(
        "imported %s (%s, %s%s): %d HF tensors -> %d Megatron parameters, %d ignored",
        hf_dir,
        family.name,
        dtype_name(prep.dtype),
        f"; {count} {method} weights dequantized" if count else "",
        report.consumed,
        report.written,
        len(report.ignored),
    )
    return manifest


def _save_weights(weights: Path, model, producer, ranked: bool, dist_checkpointing) -> None:
    """``dist_checkpointing.save`` of the model's parameters, produced as the writer reaches
    them, beside the trainer state, as NeMo's ``MegatronStrategy.save_checkpoint`` calls it."""
    strategy = streaming_save.StreamingSaveStrategy(
        producer, streaming_save.params_by_storage(model)
    )
    if ranked:
        strategy = streaming_save.fully_parallel(strategy)
    checkpoint = nemo2_context.common_state()
    checkpoint["state_dict"] = OrderedDict()
    metadata = nemo2_context.CONTENT_METADATA
    checkpoint["sharded_state_dict"] = model.sharded_state_dict(prefix="module.", metadata=metadata)
    weights.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(
        sharded_state_dict=checkpoint,
        checkpoint_dir=str(weights),
        sharded_strategy=strategy,
        validate_access_integrity=True,
        async_sharded_save=False,
        content_metadata=metadata,
    )


def write_extras(out: Path, prep: Prepared, held: dict | None = None) -> Manifest:
    """Our files beside the checkpoint's: the HF files export hands back and ``porting.json``."""
    extra_dir = out / "context" / "hf_extra"
    extras = []
    for name in EXTRA_HF_FILES:
        if (prep.hf_dir / name).exists():
            extra_dir.mkdir(parents=True, exist_ok=True)
            # copyfile, not copy2: the output's files follow this run's umask, not the
            # source file's mode (a world-readable copy of a private file, or the reverse).
            shutil.copyfile(prep.hf_dir / name, extra_dir / name)
            extras.append(name)
    manifest = Manifest(
        family=prep.family.name,
        hf_architecture=prep.hf_config["architectures"][0],
        hf_config=prep.hf_config,
        vocab_size=prep.ctx.vocab_size,
        padded_vocab_size=prep.ctx.padded_vocab_size,
        dtype=dtype_name(prep.dtype),
        tokenizer={"kind": "hf", "path": TOKENIZER_SUBDIR},
        extra_files=extras,
        fp32_tensors=prep.fp32,
        hf_config_as_written=prep.hf_config_as_written,
        hf_experts="stacked" if prep.source.experts_stacked else None,
        container=held,
    )
    write_manifest(out, manifest)
    return manifest
