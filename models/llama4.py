"""Llama 4's text model on Megatron-Core's MoE layer, with its attention as a custom spec
(:mod:`converters.llama4`).

Per layer: ``h = x + o(attn(norm(x)))``, then ``h + shared(norm(h)) + E_e(s * norm(h))`` on a
mixture layer (``e`` the top-1 expert, ``s`` the sigmoid of its logit, applied to the expert's
input: ``moe_apply_probs_on_input``) or ``h + mlp(norm(h))`` on a dense one (``moe_layer_freq``).

Megatron-Core has the rotary-free layers (``no_rope_freq``), the interleaved rotary
(``rotary_interleaved``) and the L2 q/k norm, and lacks three things this module adds:

- the L2 norm on the rotary layers only: :class:`Llama4SelfAttention` drops it on the others;
- chunked attention: :class:`Llama4DotProductAttention` masks, on the layers
  ``chunked_attention_layers`` names, every key outside the query's ``attention_chunk_size``
  block (blocks start at position 0, as transformers' ``create_chunked_causal_mask``);
- the attention temperature on the rotary-free layers: the same class scales each query by
  ``1 + attn_scale * log1p(floor((position + 1) / attn_floor_scale))`` before the scores.

One reading differs by data, not by config: transformers ranks the experts by the router
logit, Megatron-Core's sigmoid router by ``sigmoid(logit)`` in fp32, which rounds to exactly 1
above a logit of about 16.6; where two experts' logits both pass that, Megatron-Core takes the
lower-numbered one. The gate's prompts show whether a checkpoint routes there.

Both need a query's position: the sequence is whole (no packed sequences, no context
parallelism), as the class checks. The spec is Megatron-Core's local one (Transformer Engine or
not), whose core attention takes an arbitrary mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.torch_norm import L2Norm

from models.moe import MoECore


def _layer_flag(values: list[int] | None, layer_number: int) -> bool:
    # Megatron's layer_number counts from 1
    return bool(values and values[layer_number - 1])


class Llama4SelfAttention(SelfAttention):
    """``SelfAttention`` without the q/k norm on a rotary-free layer (transformers builds
    ``qk_norm`` only where the layer rotates); the norm has no weights, so nothing is stored."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if _layer_flag(config.no_rope_freq, layer_number):
            self.q_layernorm = None
            self.k_layernorm = None


class Llama4DotProductAttention(DotProductAttention):
    """Megatron-Core's local core attention with Llama 4's chunked mask or attention temperature
    on the layers that have them (module docstring)."""

    def __init__(self, config, layer_number, attn_mask_type, *args, **kwargs):
        self.chunk = (
            config.attention_chunk_size
            if _layer_flag(config.chunked_attention_layers, layer_number)
            else None
        )
        self.temperature = config.attn_temperature_tuning and _layer_flag(
            config.no_rope_freq, layer_number
        )
        if (self.chunk or self.temperature) and config.context_parallel_size > 1:
            raise ValueError(
                "Llama 4's chunked attention and attention temperature need each query's "
                "position: run at context_parallel_size 1"
            )
        if self.chunk:
            # the softmax then takes the mask it is given (its fused causal kernel would not)
            attn_mask_type = AttnMaskType.arbitrary
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        """``[sq, b, np, hn]`` query, ``[sk, b, ng, hn]`` key/value; the last ``sq`` of ``sk``
        positions are the queries'."""
        sq, sk = query.shape[0], key.shape[0]
        if self.temperature:
            position = torch.arange(sk - sq, sk, device=query.device, dtype=torch.float32)
            scale = torch.log1p(torch.floor((position + 1.0) / self.config.attn_floor_scale))
            scale = scale * self.config.attn_scale + 1.0
            query = (query * scale.view(sq, 1, 1, 1)).to(query.dtype)
        if self.chunk:
            q = torch.arange(sk - sq, sk, device=query.device).unsqueeze(1)
            k = torch.arange(sk, device=query.device).unsqueeze(0)
            masked = (k > q) | (k // self.chunk != q // self.chunk)
            masked = masked.view(1, 1, sq, sk)
            if attention_mask is not None:
                masked = masked | attention_mask.bool()
            attention_mask = masked
            if args:
                args = (AttnMaskType.arbitrary, *args[1:])
            else:
                kwargs["attn_mask_type"] = AttnMaskType.arbitrary
        return super().forward(query, key, value, attention_mask, *args, **kwargs)


def llama4_block_spec(config: Llama4Core):
    """Megatron-Core's local GPT block spec for ``config`` (dense and mixture layers by
    ``moe_layer_freq``), every layer's attention Llama 4's."""
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    norm = L2Norm if config.qk_l2_norm else IdentityOp
    for layer in spec.layer_specs:
        layer.submodules.self_attention.module = Llama4SelfAttention
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = Llama4DotProductAttention
        attention.q_layernorm = norm
        attention.k_layernorm = norm
    return spec


@dataclass
class Llama4Core(MoECore):
    """Megatron GPT config for Llama 4 (defaults: Llama 4 Scout's text model)."""

    # the family's own Megatron-Bridge provider (Bridge's has no Llama 4 attention)
    megatron_bridge_provider: ClassVar[str] = "models.llama4_bridge.Llama4ModelProvider"

    num_layers: int = 48
    hidden_size: int = 5120
    ffn_hidden_size: int = 16384
    num_attention_heads: int = 40
    num_query_groups: int = 8
    kv_channels: int | None = 128
    seq_length: int = 131072
    rotary_base: float = 500000.0
    rotary_interleaved: bool = True
    apply_rope_fusion: bool = False
    layernorm_epsilon: float = 1e-5
    no_rope_freq: list[int] | None = field(default_factory=lambda: [0, 0, 0, 1] * 12)
    # Megatron-Core 0.19's switch (0.15 has none; this spec reads it on both)
    qk_l2_norm: bool = True
    attention_chunk_size: int | None = 8192
    chunked_attention_layers: list[int] | None = field(default_factory=lambda: [1, 1, 1, 0] * 12)
    attn_temperature_tuning: bool = True
    attn_floor_scale: float = 8192.0
    attn_scale: float = 0.1
    num_moe_experts: int = 16
    moe_router_topk: int = 1
    moe_ffn_hidden_size: int = 8192
    moe_shared_expert_intermediate_size: int | None = 8192
    moe_router_score_function: str = "sigmoid"
    moe_apply_probs_on_input: bool = True
    moe_layer_freq: int | list[int] = field(default_factory=lambda: [1] * 48)
    moe_shared_expert_overlap: bool = False
    transformer_layer_spec: object = llama4_block_spec
