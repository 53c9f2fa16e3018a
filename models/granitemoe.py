"""Granite MoE on Megatron-Core's MoE layer (:mod:`models.moe`'s spec), with Granite's multipliers
added after the build (:func:`models.granite.add_multipliers`: the residual one on each mixture
layer's output, as transformers scales ``block_sparse_moe``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from models.granite import Multiplied
from models.moe import MoECore


@dataclass
class GraniteMoeCore(Multiplied, MoECore):
    """Megatron GPT config for Granite MoE (defaults: granite-3.0-3b-a800m): the MoE family's
    router (top-k then softmax) and Granite's ``softmax_scale`` and multipliers."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.granitemoe_bridge.GraniteMoeModelProvider"

    num_layers: int = 32
    hidden_size: int = 1536
    ffn_hidden_size: int = 512
    moe_ffn_hidden_size: int = 512
    num_attention_heads: int = 24
    num_query_groups: int = 8
    num_moe_experts: int = 40
    moe_router_topk: int = 8
    seq_length: int = 4096
    share_embeddings_and_output_weights: bool = True
    add_qkv_bias: bool = False
    softmax_scale: float | None = 0.015625
    embedding_multiplier: float = 12.0
    residual_multiplier: float = 0.22
    logits_scaling: float = 6.0
