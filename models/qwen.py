"""The Qwen2 / Qwen3 decoders on the stock Megatron GPT layer spec.

A Llama layout with two attention knobs Megatron has as config fields: Qwen2's q/k/v biases
without an o_proj or MLP bias (``add_qkv_bias``), and Qwen3's per-head RMSNorm on queries and keys
before the rotary embedding (``qk_layernorm``, built on ``kv_channels`` by the layer spec).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from models.llama import LlamaCore
from porting.mcore import moved_to


@dataclass
class QwenCore(LlamaCore):
    """Megatron GPT config for Qwen2 (``add_qkv_bias``) and Qwen3 (``qk_layernorm``)."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.qwen_bridge.QwenModelProvider"

    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    num_query_groups: int = 4
    rotary_base: float = 1000000.0
    layernorm_epsilon: float = 1e-6


# checkpoints written before the NeMo classes moved to models.qwen_nemo name them here
__getattr__ = moved_to(__name__, "models.qwen_nemo", "QwenConfig", "QwenModel")
