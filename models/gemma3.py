"""Gemma 3 (text) on Megatron-Core: Gemma 2's decoder (:mod:`models.gemma`) with a
``(1 + w)`` RMSNorm on every query and key head, and two rotary tables.

transformers' ``Gemma3TextModel`` rotates the sliding-window ("local") layers with an unscaled
table of base ``rope_local_base_freq`` and the full-attention ("global") layers with one of base
``rope_theta`` under its ``rope_scaling`` (linear on the larger checkpoints), while Megatron-Core's
``GPTModel`` computes one table for every layer. Here the model's rotary module returns both
tables stacked, ``[2, seq, 1, 1, dim]`` (local first), computed by two stock
``RotaryEmbedding`` objects (so context-parallel slicing and linear scaling are Megatron's own),
and each layer's :class:`Gemma3SelfAttention` takes the one its layer type names. A layer's type
is the one fact that already decides its window (``window_attn_skip_freq``, a 0/1 list per layer),
so the window and the table cannot disagree. NeMo 2.7.3's ``gemma3.py`` does the same in its own
way (a fixed local:global pattern); this reads the per-layer list instead, since ``layer_types``
may be any pattern.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import is_layer_window_attention

from models.gemma import GemmaCore
from models.gemma_spec import build_gemma_block_spec
from porting.mcore import moved_to


class LocalGlobalRotaryEmbedding(torch.nn.Module):
    """Both rotary tables of a Gemma 3 model, stacked as ``(local, global)``.

    ``global_rope`` is the model's own (base ``rotary_base``, ``seq_len_interpolation_factor``
    for linear scaling); ``local_rope`` is unscaled with base ``rotary_base_local``. Neither has
    parameters or persistent buffers, so checkpoints are those of a stock ``GPTModel``."""

    def __init__(self, global_rope: RotaryEmbedding, local_rope: RotaryEmbedding) -> None:
        super().__init__()
        self.global_rope, self.local_rope = global_rope, local_rope

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        """The table length ``GPTModel`` asks for (the same for both tables)."""
        return self.global_rope.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, *args, **kwargs) -> torch.Tensor:
        """``[2, seq, 1, 1, dim]``: the local table, then the global one. The rest (offset,
        packed_seq, Megatron-Core 0.19's cp_group) goes to both as given."""
        return torch.stack(
            (
                self.local_rope(max_seq_len, *args, **kwargs),
                self.global_rope(max_seq_len, *args, **kwargs),
            )
        )


class Gemma3SelfAttention(SelfAttention):
    """Self-attention that rotates with its layer's table of the stacked pair: the local one on
    sliding-window layers, the global one elsewhere (as ``Gemma3DecoderLayer`` picks
    ``position_embeddings_local`` / ``_global``)."""

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        """``SelfAttention.forward`` with ``rotary_pos_emb`` narrowed to this layer's table."""
        if rotary_pos_emb is not None:
            local = is_layer_window_attention(
                self.config.window_size, self.config.window_attn_skip_freq, self.layer_number
            )
            rotary_pos_emb = rotary_pos_emb[0 if local else 1]
        return super().forward(
            hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs
        )


def gemma3_block_spec(config: Gemma3Core, vp_stage=None) -> ModuleSpec:
    """Gemma 2's block spec with per-head q/k norms and :class:`Gemma3SelfAttention`."""
    return build_gemma_block_spec(
        config,
        sandwich=True,
        softcap=False,  # converters.gemma3: Gemma 3's attention has no soft-cap
        vp_stage=vp_stage,
        qk_norm=True,
        attention=Gemma3SelfAttention,
    )


@dataclass
class Gemma3Core(GemmaCore):
    """Megatron GPT config for Gemma 3 text models (defaults: gemma-3-1b). ``rotary_base`` and
    ``seq_len_interpolation_factor`` are the global layers' rotary settings, ``rotary_base_local``
    the local layers' base; ``window_attn_skip_freq`` (0/1 per layer) says which layers are local."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.gemma3_bridge.Gemma3ModelProvider"

    num_layers: int = 26
    hidden_size: int = 1152
    ffn_hidden_size: int = 6912
    num_attention_heads: int = 4
    num_query_groups: int = 1
    kv_channels: int = 256
    seq_length: int = 32768
    rotary_base: float = 1_000_000.0
    rotary_base_local: float = 10_000.0
    softmax_scale: float | None = 256**-0.5
    window_size: tuple[int, int] | None = (511, 0)
    window_attn_skip_freq: int | list[int] | None = None
    qk_layernorm: bool = True
    sandwich_norms: bool = True
    transformer_layer_spec: ModuleSpec | type = gemma3_block_spec

    def __post_init__(self) -> None:
        if self.window_attn_skip_freq is None:
            # transformers' default pattern: every sixth layer global
            self.window_attn_skip_freq = [int((i + 1) % 6 != 0) for i in range(self.num_layers)]
        super().__post_init__()

    def configure_model(self, tokenizer, pre_process=None, post_process=None, vp_stage=None):
        """Gemma's model (embedding scale, final soft-cap), with both rotary tables."""
        model = super().configure_model(tokenizer, pre_process, post_process, vp_stage)
        rope = getattr(model, "rotary_pos_emb", None)
        if rope is not None:
            local = RotaryEmbedding(
                kv_channels=self.kv_channels,
                rotary_percent=self.rotary_percent,
                rotary_interleaved=self.rotary_interleaved,
                rotary_base=self.rotary_base_local,
                use_cpu_initialization=self.use_cpu_initialization,
                cp_group=rope.cp_group,
            )
            local.inv_freq = local.inv_freq.to(rope.inv_freq.device)
            model.rotary_pos_emb = LocalGlobalRotaryEmbedding(rope, local)
        return model


# checkpoints written before the NeMo classes moved to models.gemma3_nemo name them here
__getattr__ = moved_to(__name__, "models.gemma3_nemo", "Gemma3Config", "Gemma3Model")
