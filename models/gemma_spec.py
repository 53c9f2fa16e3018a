"""Gemma's and Gemma 2's decoder pieces as Megatron-Core modules and a block spec (no NeMo needed).

What the stock local spec lacks, each a small module with stock parameter names plus one:

- :class:`GemmaRMSNorm`: ``x / rms(x) * (1 + w)`` computed in fp32 and cast back, as HF's
  ``GemmaRMSNorm``; the weight is stored zero-centred, as HF stores it. (Megatron's
  ``layernorm_zero_centered_gamma`` is the same maths, but its local norm refuses it and its TE
  norm does not compute in fp32 for a bf16 input.)
- :class:`PostNormRowParallelLinear`: Gemma 2's sandwich norms. The norm after attention and the
  one after the MLP sit on the output of ``linear_proj`` / ``linear_fc2``, before the residual add,
  so they live inside those modules as ``post_layernorm`` (the names Megatron-Bridge and NeMo
  use). Under tensor parallelism the row-parallel output is already reduced when it is normed.
- :class:`SoftcapDotProductAttention`: Gemma 2's ``tanh(s / cap) * cap`` on the scaled scores,
  before the mask and the fp32 softmax, as HF's eager attention.

Sliding windows, ``query_pre_attn_scalar`` and GeGLU are Megatron config fields
(``window_size`` with a per-layer ``window_attn_skip_freq`` list, ``softmax_scale``,
``activation_func`` with ``gated_linear_unit``). Embedding scaling and the final logit soft-cap are
model-level and added by :mod:`models.gemma`. The spec uses local modules on every device: the
fp32 norm is the point, and TE's fused norm+linear would bypass it.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from porting.mcore import block_of


class GemmaRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred weight, ``(1 + w)``, in fp32 (see the module docstring)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` normed over its last dimension; same dtype as ``x``."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class PostNormRowParallelLinear(RowParallelLinear):
    """A row-parallel linear layer whose (reduced) output is normed by :class:`GemmaRMSNorm`."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = GemmaRMSNorm(config, output_size, config.layernorm_epsilon)

    def forward(self, input_: torch.Tensor):
        """``(post_layernorm(x W^T), bias)``; Gemma has no linear biases."""
        output, bias = super().forward(input_)
        return self.post_layernorm(output), bias


class _Softcapped(torch.nn.Module):
    def __init__(self, softmax: torch.nn.Module, cap: float) -> None:
        super().__init__()
        self.softmax, self.cap = softmax, cap

    def forward(self, scores: torch.Tensor, mask, *args, **kwargs) -> torch.Tensor:
        return self.softmax(torch.tanh(scores / self.cap) * self.cap, mask, *args, **kwargs)


class SoftcapDotProductAttention(DotProductAttention):
    """Core attention with Gemma 2's score soft-cap (``config.attn_logit_softcapping``)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.scale_mask_softmax = _Softcapped(
            self.scale_mask_softmax, config.attn_logit_softcapping
        )


def build_gemma_block_spec(
    config,
    *,
    sandwich: bool,
    softcap: bool,
    vp_stage=None,
    qk_norm: bool = False,
    attention: type[SelfAttention] = SelfAttention,
) -> ModuleSpec:
    """The decoder block spec: Gemma's layers (sandwich norms for Gemma 2) and its final norm.

    ``qk_norm`` and ``attention`` are Gemma 3's: a :class:`GemmaRMSNorm` on each query and key
    head, and a ``SelfAttention`` subclass that picks its layer's rotary table
    (:mod:`models.gemma3`)."""
    proj = PostNormRowParallelLinear if sandwich else RowParallelLinear
    head_norm = GemmaRMSNorm if qk_norm else IdentityOp
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=GemmaRMSNorm,
            self_attention=ModuleSpec(
                module=attention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SoftcapDotProductAttention if softcap else DotProductAttention,
                    linear_proj=proj,
                    q_layernorm=head_norm,
                    k_layernorm=head_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=GemmaRMSNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=proj),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return block_of(layer, GemmaRMSNorm, config, vp_stage)
