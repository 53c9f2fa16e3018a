"""Megatron-Core process groups and model loading from a NeMo 2.0 checkpoint, without Lightning.

Verification and export only need the Megatron model and its weights; building it straight from
the checkpoint's NeMo context and loading ``weights/`` with Megatron's own ``dist_checkpointing``
(the reader of that format) avoids a Lightning trainer and works at any tensor-parallel size.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from porting import cpu
from porting.errors import PortingError

log = logging.getLogger(__name__)


def init_parallel(tp: int = 1, pp: int = 1, rank: int = 0, world_size: int = 1) -> None:
    """Initialise torch.distributed (gloo on the CPU, nccl on GPUs) and Megatron's parallel state.

    Reuses an existing process group and model-parallel state when the sizes already match (a NeMo
    trainer set up by an import, say); re-initialises the model-parallel groups otherwise.
    """
    from megatron.core import parallel_state

    cpu.enable()
    if not torch.distributed.is_initialized():
        cpu.ensure_rendezvous_env()
        backend = "nccl" if cpu.cuda_available() else "gloo"
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


def load_nemo_model_context(ckpt: str | Path):
    """The NeMo model object (config + tokenizer, no weights) recorded in a checkpoint's context."""
    from nemo.lightning.io import load_context

    ctx = Path(ckpt) / "context"
    if not (ctx / "io.json").exists():
        raise PortingError(f"{ctx}: no io.json; not a NeMo 2.0 checkpoint")
    return load_context(ctx, subpath="model")


def build_mcore_model(nemo_model) -> torch.nn.Module:
    """Instantiate the Megatron-Core module for the current parallel state (no weights loaded)."""
    from megatron.core import parallel_state

    config = nemo_model.config
    config.perform_initialization = False
    # A training checkpoint records the layout it was trained with; build for the current one
    # (dist_checkpointing reshards on load).
    config.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    config.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    config.virtual_pipeline_model_parallel_size = None
    config.sequence_parallel = False
    config.context_parallel_size = 1
    cpu.cpu_safe_config(config)
    model = config.configure_model(nemo_model.tokenizer)
    model.eval()
    return model


def load_weights(model: torch.nn.Module, ckpt: str | Path) -> None:
    """Load ``weights/`` into ``model`` with Megatron's ``dist_checkpointing`` (resharding as needed).

    NeMo saves the model under the ``module.`` prefix (``nemo/lightning/megatron_parallel.py``).
    """
    from megatron.core import dist_checkpointing

    weights = Path(ckpt) / "weights"
    sharded = model.sharded_state_dict(prefix="module.")
    try:
        loaded = dist_checkpointing.load(sharded, str(weights), strict="assume_ok_unexpected")
    except Exception as err:  # Megatron raises many types; name the checkpoint either way
        raise PortingError(f"{weights}: cannot load Megatron weights ({err})") from err
    state = {k.removeprefix("module."): v for k, v in loaded.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise PortingError(f"{weights}: checkpoint lacks parameter(s): {', '.join(missing[:10])}")


def load_mcore_from_checkpoint(ckpt: str | Path, dtype: torch.dtype | None = None):
    """Build the Megatron model recorded in ``ckpt`` and load its weights.

    Returns ``(mcore_model, nemo_model)``; the parallel state must be initialised first
    (:func:`init_parallel`). ``dtype`` casts the loaded model (e.g. fp32 for parity).
    """
    nemo_model = load_nemo_model_context(ckpt)
    model = build_mcore_model(nemo_model)
    load_weights(model, ckpt)
    if dtype is not None:
        model = model.to(dtype)
    return model, nemo_model


@torch.no_grad()
def mcore_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Full logits ``[batch, seq, padded_vocab]`` of a Megatron GPT model (causal, no mask given).

    Under tensor parallelism the vocabulary-parallel logits are gathered across the TP group.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(model.parameters()).device
    ids = input_ids.to(device)
    positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    out = model(ids, positions, None)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        out = gather_from_tensor_model_parallel_region(out)
    return out.float().cpu()
