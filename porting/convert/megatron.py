"""Megatron-Core process groups, family configs, and model loading from one of our checkpoints,
without Lightning.

Verification and export only need the Megatron model and its weights; building it from our
manifest (the HF config through the family's config map, never NeMo's ``io.json``) and reading
its tensors region by region (:mod:`porting.convert.dist_reader`) avoids a Lightning trainer and
works at any tensor-parallel size and in each of our layouts (:mod:`porting.convert.layouts`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from porting import cpu
from porting.contract import config_map, named
from porting.contract.family import Family
from porting.convert import ranks
from porting.convert.checkpoint import Checkpoint, open_checkpoint
from porting.convert.preflight import check_nemo_counts
from porting.errors import PortingError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def padded_vocab(vocab_size: int, divisible_by: int) -> int:
    """Megatron's vocabulary padding (``megatron/training/tokenizer``: ``_vocab_size_with_padding``)."""
    return int(math.ceil(vocab_size / divisible_by) * divisible_by)


def config_arguments(
    family: Family,
    hf_config: dict,
    dtype: torch.dtype,
    vocab_divisor: int,
    padded_vocab_size: int | None = None,
) -> dict:
    """The keyword arguments of the family's Megatron config for ``hf_config`` (what NeMo's
    ``context/io.json`` records of it: :mod:`porting.convert.nemo2_context`).

    ``padded_vocab_size`` (from a manifest) replaces the padding ``vocab_divisor`` would give.
    Raises :class:`PortingError` for config fields the family cannot represent.
    """
    left = config_map.undecided(family.config_entries)
    if left:
        raise PortingError(
            f"family {family.name} ({family.source}): {len(left)} HF config field(s) still to "
            "decide: " + ", ".join(f"{e.hf} (seen {e.seen!r})" for e in left) + ". Map each "
            "(Field, Derived), Carry it if it does not change the maths, or Require the values "
            "the family models (docs/families.md)"
        )
    kwargs = config_map.to_mcore(hf_config, family.config_entries)
    vocab = hf_config.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise PortingError(f"config.json: vocab_size must be a positive integer, not {vocab!r}")
    kwargs.update(
        vocab_size=padded_vocab_size or padded_vocab(vocab, vocab_divisor),
        make_vocab_size_divisible_by=vocab_divisor,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
    )
    return named.resolve(kwargs)


def build_config(
    family: Family,
    hf_config: dict,
    dtype: torch.dtype,
    vocab_divisor: int,
    padded_vocab_size: int | None = None,
    *,
    nemo: bool = False,
):
    """The family's Megatron config for ``hf_config`` (:func:`config_arguments`) and its shape
    context.

    ``nemo``: NeMo's config class (what a NeMo model is built from and ``context/io.json``
    records); otherwise the family's NeMo-free one (``Family.core_config_cls``), which builds
    the same Megatron-Core model without loading NeMo.
    """
    kwargs = config_arguments(family, hf_config, dtype, vocab_divisor, padded_vocab_size)
    # NeMo records a config's constructor arguments for context/io.json by wrapping its class's
    # __init__ on first use, and skips a class whose flag it finds by getattr: a subclass built
    # after its parent inherits the parent's flag, stays unwrapped, and its context then records
    # every field Megatron filled in (init_method as a partial of torch.nn.init.normal_).
    config_cls = family.config_class(nemo=nemo)
    if nemo and family.core_config_cls is not None:
        core = family.config_class(nemo=False)
        if not issubclass(config_cls, core):
            # a family made from another by dataclasses.replace that changed config_cls only
            raise PortingError(
                f"family {family.name} ({family.source}): its config_cls {config_cls.__name__} "
                f"is not built on its core_config_cls {core.__name__}, so verify and export "
                "would build another model than import; set core_config_cls to the NeMo-free "
                "config under config_cls (or None)"
            )
    if "__wrapped_init__" not in vars(config_cls):
        config_cls.__wrapped_init__ = False
    config = config_cls(**kwargs)
    return config, family.shape_context(config, hf_config["vocab_size"])


def init_parallel(tp: int = 1, pp: int = 1, rank: int = 0, world_size: int = 1) -> None:
    """Initialise torch.distributed (gloo on the CPU, nccl on GPUs) and Megatron's parallel state.

    Reuses an existing process group and model-parallel state when the sizes already match (a NeMo
    trainer set up by an import, say); re-initialises the model-parallel groups otherwise.
    """
    from megatron.core import parallel_state

    cpu.enable()
    if not torch.distributed.is_initialized():
        backend = "nccl" if cpu.cuda_available() else "gloo"
        if world_size == 1 and ranks.staging() is not None and ranks.world_size() > 1:
            # a rank of a launched conversion (porting.convert.ranks): the launcher's world
            torch.distributed.init_process_group(backend=backend)
        else:
            cpu.ensure_rendezvous_env(world_size)
            torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world_size)
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == pp
        ):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def shutdown_parallel() -> None:
    """Destroy Megatron's parallel state and the process group, if any."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def checkpoint_config(
    ckpt: Checkpoint | str | Path,
    family: Family,
    dtype: torch.dtype | None = None,
    *,
    nemo: bool = False,
):
    """The Megatron config of one of our checkpoints (a path is opened here), rebuilt from its
    manifest.

    The HF config recorded in ``porting.json`` goes through the family's config map, as on
    import; ``context/io.json`` is never read, since NeMo deserialises it by importing and calling
    whatever it names. ``dtype`` is the precision the model will run in (default: the
    checkpoint's); a bf16 checkpoint run in fp32 for parity must not keep ``bf16=True``, which
    makes Megatron's fp32 softmax cast its output back to bf16. ``nemo``: NeMo's config class
    (a NeMo model, for training), not the NeMo-free one (:func:`build_config`).
    """
    checkpoint = open_checkpoint(ckpt)
    manifest = checkpoint.manifest
    if manifest.family != family.name:
        raise PortingError(
            f"{checkpoint.path}: a {manifest.family!r} checkpoint, not one of family "
            f"{family.name!r}"
        )
    config, _ = build_config(
        family,
        manifest.hf_config,
        DTYPES[manifest.dtype] if dtype is None else dtype,
        vocab_divisor=1,
        padded_vocab_size=manifest.padded_vocab_size,
        nemo=nemo,
    )
    # Before anyone builds the model this config describes: its size against the weights' own.
    check_nemo_counts(checkpoint, config)
    return config


def build_mcore_model(config) -> torch.nn.Module:
    """Instantiate the Megatron-Core module for the current parallel state (no weights loaded)."""
    from megatron.core import parallel_state

    config.perform_initialization = False
    # Build for the current layout (dist_checkpointing reshards on load).
    config.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    config.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    config.virtual_pipeline_model_parallel_size = None
    config.sequence_parallel = False
    config.context_parallel_size = 1
    cpu.kernel_safe_config(config)
    model = config.configure_model(None)
    devices = {p.device.type for p in model.parameters()}
    if {"cuda", "cpu"} <= devices:
        # Megatron's local spec puts linear layers on the current device but builds its torch
        # norms (WrappedTorchNorm) on the host; training moves the module, so must we. (A model
        # built on the meta device, for its shapes, stays there.)
        model.cuda(torch.cuda.current_device())
    model.eval()
    return model


def load_weights(model: torch.nn.Module, ckpt: Checkpoint | str | Path) -> None:
    """Load the checkpoint's tensors (a path is opened here) into ``model``, whatever our layout
    (its key prefix: :attr:`porting.convert.layouts.base.Located.prefix`).

    Read through :class:`~porting.convert.dist_reader.DistCheckpointReader`, not Megatron's
    ``dist_checkpointing.load``: that one unpickles ``.metadata`` and the common state with plain
    ``pickle``, and a checkpoint trained elsewhere is not trusted code.
    """
    from porting.convert.dist_reader import CheckpointParameters, DistCheckpointReader

    loc = open_checkpoint(ckpt).located
    reader = DistCheckpointReader(loc.weights)
    sharded = model.sharded_state_dict(prefix=loc.prefix)
    params = dict(model.named_parameters())
    # persistent buffers are checkpoint state as well (a router's expert_bias)
    saved = set(model.state_dict(keep_vars=True))
    params |= {name: b for name, b in model.named_buffers() if name in saved}
    stored = CheckpointParameters(reader, sharded, params, loc.prefix)
    with torch.no_grad():
        for name, p in params.items():
            value = stored[name]
            if value.shape != p.shape:
                raise PortingError(
                    f"{loc.weights}: {name!r} is {tuple(value.shape)}, the model's {tuple(p.shape)}"
                )
            p.copy_(value)


def load_mcore_from_checkpoint(
    ckpt: Checkpoint | str | Path, family: Family, dtype: torch.dtype | None = None
) -> tuple[torch.nn.Module, object]:
    """Build the Megatron model of our checkpoint ``ckpt`` (from its manifest; a path is opened
    here) and load its weights.

    Returns ``(mcore_model, config)``; the parallel state must be initialised first
    (:func:`init_parallel`). ``dtype`` casts the loaded model (e.g. fp32 for parity).
    """
    checkpoint = open_checkpoint(ckpt)
    config = checkpoint_config(checkpoint, family, dtype)
    model = build_mcore_model(config)
    load_weights(model, checkpoint)
    if dtype is not None:
        model = model.to(dtype)
    return model, config


@contextmanager
def main_head_only(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` without its multi-token-prediction block: Megatron-Core 0.15.3 runs the block
    only towards a loss (``GPTModel._postprocess`` clones the labels), and logits are the main
    head's. 0.19 also reads the config's ``mtp_num_layers`` there (to split the hidden states
    among the heads' losses), so that is unset too while the model runs; the model is built."""
    had = getattr(model, "mtp_process", False)
    config = getattr(model, "config", None)
    layers = getattr(config, "mtp_num_layers", None)
    model.mtp_process = False
    if layers:
        config.mtp_num_layers = None
    try:
        yield
    finally:
        model.mtp_process = had
        if layers:
            config.mtp_num_layers = layers


def _gathered(out: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        out = gather_from_tensor_model_parallel_region(out)
    return out.float().cpu()


def _positions(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    return ids, torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)


@torch.no_grad()
def mcore_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Full logits ``[batch, seq, padded_vocab]`` of a Megatron GPT model (causal, no mask given).

    Under tensor parallelism the vocabulary-parallel logits are gathered across the TP group.
    """
    ids, positions = _positions(model, input_ids)
    with main_head_only(model):
        out = model(ids, positions, None)
    return _gathered(out)


@torch.no_grad()
def mtp_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The logits ``[batch, seq, padded_vocab]`` of each multi-token-prediction layer of a
    Megatron GPT model: layer ``k``'s at position ``i`` predict token ``i + k + 2`` from tokens
    up to ``i + k + 1`` (its last ``k + 1`` positions read a rolled-in pad and mean nothing).

    The block's output (the main hidden states and each layer's, stacked along the sequence) is
    taken where the model makes it, and each layer's put through the shared output layer, as
    ``GPTModel._postprocess`` does for its loss.
    """
    n = getattr(model.config, "mtp_num_layers", None) or 0
    if not getattr(model, "mtp_process", False) or not n:
        raise PortingError("the model has no multi-token-prediction block")
    ids, positions = _positions(model, input_ids)
    seen: list[torch.Tensor] = []
    hook = model.mtp.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        model(ids, positions, None, labels=ids)  # the block runs only towards a loss
    finally:
        hook.remove()
    tied = model.share_embeddings_and_output_weights
    weight = model.shared_embedding_or_output_weight() if tied else None
    out = []
    for hidden in torch.chunk(seen[0], 1 + n, dim=0)[1:]:
        logits, _ = model.output_layer(hidden, weight=weight)
        out.append(_gathered(logits.transpose(0, 1).contiguous()))
    return out
