"""Gemma and Gemma 2 on the custom spec of :mod:`models.gemma_spec`.

Gemma: a Llama-like decoder with a ``(1 + w)`` fp32 RMSNorm, the embeddings multiplied by
``sqrt(hidden_size)`` (rounded to the activation dtype, as HF does), a GeGLU MLP (tanh GELU by
default) and a ``head_dim`` apart from hidden/heads. Gemma 2 adds sandwich norms (after attention
and after the MLP), ``tanh`` soft-capping of the attention scores and of the final logits, a
softmax scale of ``query_pre_attn_scalar ** -0.5``, and a sliding window on the layers its
``layer_types`` name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec

from models.gemma_spec import build_gemma_block_spec
from porting import cpu
from porting.mcore import GPTCore, moved_to


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (``transformers``' ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU (``transformers``' ``gelu``); a function of ours so that NeMo's context
    names it here rather than as ``torch._C._nn.gelu``."""
    return F.gelu(x)


def gemma_block_spec(config: GemmaCore, vp_stage=None) -> ModuleSpec:
    """The block spec for ``config`` (local modules on every device; see models.gemma_spec)."""
    return build_gemma_block_spec(
        config,
        sandwich=config.sandwich_norms,
        softcap=config.attn_logit_softcapping is not None,
        vp_stage=vp_stage,
    )


@dataclass
class GemmaCore(GPTCore):
    """Megatron GPT config for Gemma (defaults: Gemma-2B) and Gemma 2 (``sandwich_norms`` and the
    soft-caps set). ``window_size`` and ``window_attn_skip_freq`` (a per-layer 0/1 list) carry
    Gemma 2's alternating sliding window."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.gemma_bridge.GemmaModelProvider"

    normalization: str = "RMSNorm"
    activation_func: Callable = gelu_tanh
    gated_linear_unit: bool = True
    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    add_bias_linear: bool = False
    share_embeddings_and_output_weights: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_softmax_in_fp32: bool = True
    seq_length: int = 8192
    num_layers: int = 18
    hidden_size: int = 2048
    ffn_hidden_size: int = 16384
    num_attention_heads: int = 8
    num_query_groups: int = 1
    kv_channels: int = 256
    rotary_base: float = 10000.0
    layernorm_epsilon: float = 1e-6
    init_method_std: float = 0.02
    # the fused kernels are GELU-tanh/SwiGLU-specific or skip the soft-cap; the local path is exact
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True
    transformer_layer_spec: ModuleSpec | Callable = gemma_block_spec

    sandwich_norms: bool = False
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # what keeps Megatron-Bridge's GPTModelProvider from building this model (porting.convert.bridge)
    megatron_bridge_refusal: ClassVar[str] = (
        "the embedding scale and the final soft-cap are added by the family's configure_model, "
        "which Bridge's provider does not run"
    )

    def __post_init__(self) -> None:
        # TransformerConfig.__post_init__ rejects fusions whose kernels are missing: off first
        # (every CUDA-only one on the CPU; under CUDA those TE / apex would provide).
        cpu.kernel_safe_config(self)
        super().__post_init__()

    def configure_model(self, tokenizer, pre_process=None, post_process=None, vp_stage=None):
        """Build the Megatron-Core GPT model, then add the embedding scale and the logit soft-cap."""
        model = super().configure_model(tokenizer, pre_process, post_process, vp_stage)
        scale = self.hidden_size**0.5
        if getattr(model, "embedding", None) is not None:
            model.embedding.register_forward_hook(
                lambda mod, args, out: out * torch.tensor(scale, dtype=out.dtype)
            )
        cap = self.final_logit_softcapping
        if cap is not None and getattr(model, "output_layer", None) is not None:
            model.output_layer.register_forward_hook(
                lambda mod, args, out: (torch.tanh(out[0] / cap) * cap, *out[1:])
            )
        return model


# checkpoints written before the NeMo classes moved to models.gemma_nemo name them here
__getattr__ = moved_to(__name__, "models.gemma_nemo", "GemmaConfig", "GemmaModel")
