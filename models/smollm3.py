"""SmolLM3 on the stock GPT spec: the Llama decoder with rotary-free layers.

Megatron-Core's ``no_rope_freq`` (a list, 1 where the layer skips the rotary embedding) makes
``SelfAttention.forward`` drop ``rotary_pos_emb`` on those layers, which is transformers'
``SmolLM3Attention`` with ``use_rope`` off: q and k as projected, no position encoding. A sliding
window on some layers is ``window_size`` with ``window_attn_skip_freq``, as Gemma 2's. Every field
is Megatron-Core's own, so the class only sets SmolLM3-3B's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from models.llama import LlamaCore


@dataclass
class SmolLM3Core(LlamaCore):
    """Megatron GPT config for SmolLM3 (defaults: SmolLM3-3B, every 4th of 36 layers rotary-free)."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.smollm3_bridge.SmolLM3ModelProvider"

    num_layers: int = 36
    hidden_size: int = 2048
    ffn_hidden_size: int = 11008
    num_attention_heads: int = 16
    num_query_groups: int = 4
    seq_length: int = 65536
    rotary_base: float = 5000000.0
    layernorm_epsilon: float = 1e-6
    share_embeddings_and_output_weights: bool = True
    no_rope_freq: list[int] | None = field(default_factory=lambda: [0, 0, 0, 1] * 9)
