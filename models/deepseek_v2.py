"""The DeepSeek-V2 decoder (DeepSeek-V2-Lite) on Megatron-Core's multi-latent attention and MoE
layers (:mod:`converters.deepseek_v2`).

DeepSeek-V3's layers and block spec (:mod:`models.deepseek`) with transformers' V2 routing: a
softmax over every expert, its top-k as they are (no renormalisation, no expert bias), times
``routed_scaling_factor`` (``DeepseekV2MoEGate``); Megatron-Core's router does the same with
``moe_router_pre_softmax`` and a softmax score, in fp32 (``moe_router_dtype``) as transformers
computes the gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from models.deepseek import DeepseekCore


@dataclass
class DeepseekV2Core(DeepseekCore):
    """Megatron GPT config for the DeepSeek-V2 family (defaults: DeepSeek-V2-Lite's shapes and
    routing, unscaled rotary; the converter sets every field a checkpoint decides)."""

    megatron_bridge_provider: ClassVar[str] = "models.deepseek_v2_bridge.DeepseekV2ModelProvider"

    num_layers: int = 27
    hidden_size: int = 2048
    ffn_hidden_size: int = 10944
    num_attention_heads: int = 16
    num_query_groups: int = 16
    q_lora_rank: int | None = None
    num_moe_experts: int = 64
    moe_ffn_hidden_size: int = 1408
    moe_shared_expert_intermediate_size: int | None = 2816
    moe_router_topk: int = 6
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = 1.0
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = True
    moe_router_enable_expert_bias: bool = False
    moe_layer_freq: int | list[int] = field(default_factory=lambda: [0] + [1] * 26)
