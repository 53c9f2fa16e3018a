"""Phi-3 on Megatron-Core: the Llama decoder (:mod:`models.llama`, stock GPT spec) with a
sliding window, partial rotary (``rotary_percent``) and LongRoPE.

LongRoPE (``transformers`` ``modeling_rope_utils._compute_longrope_parameters`` and
``longrope_frequency_update``, 4.57): the frequencies are ``1 / (f_i * base^(2i/d))`` with ``f`` the
``short_factor`` list while the sequence (``max(position_ids) + 1``) is at most
``original_max_position_embeddings`` and the ``long_factor`` list beyond, and cos and sin are
multiplied by the attention factor on every length. :class:`LongRopeRotaryEmbedding` picks the
table from the length ``GPTModel`` asks its rotary embedding for, which is that same length for a
forward pass from position 0 (under inference with a KV cache it is the context's maximum length,
where transformers switches as the sequence grows). The attention factor is Megatron's ``mscale``
on cos and sin (``rope_utils._apply_rotary_pos_emb_bshd``), which ``SelfAttention`` takes from the
config's three ``yarn_*`` fields (``_yarn_get_concentration_factor_from_config``): they are set to
give exactly the factor, and the fused rotary kernel, which drops ``mscale``, is switched off. cos
and sin are scaled on the rotated channels only, as transformers does under a partial rotary; a
``softmax_scale`` would scale the passed-through channels too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from models.llama import LlamaCore
from porting.mcore import moved_to


def longrope_inv_freq(
    factors: list[float], *, base: float, dim: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[dim // 2]`` frequencies ``1 / (factors * base ** (arange(0, dim, 2) / dim))``, in
    transformers' order of fp32 operations."""
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext * base**shape)


class LongRopeRotaryEmbedding(torch.nn.Module):
    """The model's ``RotaryEmbedding`` with its frequencies switched by the requested length:
    ``short`` up to ``original_max_position_embeddings``, ``long`` beyond."""

    def __init__(self, rope, short: torch.Tensor, long: torch.Tensor, original: int) -> None:
        super().__init__()
        self.rope, self.short, self.long, self.original = rope, short, long, original

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        """The table length ``GPTModel`` asks for (the rope's own rule)."""
        return self.rope.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, *args, **kwargs) -> torch.Tensor:
        """The stock table for ``max_seq_len`` positions, of the factors that length selects;
        the rest (offset, packed_seq, Megatron-Core 0.19's cp_group) goes to the rope as given."""
        chosen = self.long if max_seq_len > self.original else self.short
        self.rope.inv_freq = chosen.to(self.rope.inv_freq.device)
        return self.rope(max_seq_len, *args, **kwargs)


@dataclass
class Phi3Core(LlamaCore):
    """Megatron GPT config for Phi-3 (defaults: Phi-3-mini-4k). ``longrope_short_factor`` (a list,
    or None for no LongRoPE), ``longrope_long_factor``, ``longrope_original_max_position_embeddings``
    and ``longrope_attention_factor`` carry LongRoPE; the ``yarn_*`` fields are derived from the
    attention factor (see the module docstring) and are not set by hand."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.phi3_bridge.Phi3ModelProvider"

    num_layers: int = 32
    hidden_size: int = 3072
    ffn_hidden_size: int = 8192
    num_attention_heads: int = 32
    num_query_groups: int = 32
    seq_length: int = 4096
    window_size: tuple[int, int] | None = (2046, 0)

    longrope_short_factor: list[float] | None = None
    longrope_long_factor: list[float] | None = None
    longrope_original_max_position_embeddings: int = 4096
    longrope_attention_factor: float = 1.0
    yarn_rotary_scaling_factor: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        a = self.longrope_attention_factor
        if a != 1.0:
            # Megatron's mscale = (0.1 m ln s + 1) / (0.1 m' ln s + 1); s = e, m' = 0 give 1 + 0.1 m
            self.yarn_rotary_scaling_factor = math.e
            self.yarn_mscale = (a - 1.0) / 0.1
            self.yarn_mscale_all_dim = 0.0
            self.apply_rope_fusion = False
        super().__post_init__()

    def configure_model(self, tokenizer, pre_process=None, post_process=None, vp_stage=None):
        """The Llama model, with LongRoPE's switched tables where configured."""
        model = super().configure_model(tokenizer, pre_process, post_process, vp_stage)
        rope = getattr(model, "rotary_pos_emb", None)
        if self.longrope_short_factor is not None and rope is not None:
            dim = 2 * rope.inv_freq.numel()
            device = rope.inv_freq.device
            short, long = (
                longrope_inv_freq(f, base=self.rotary_base, dim=dim, device=device)
                for f in (self.longrope_short_factor, self.longrope_long_factor)
            )
            model.rotary_pos_emb = LongRopeRotaryEmbedding(
                rope, short, long, self.longrope_original_max_position_embeddings
            )
        return model


# checkpoints written before the NeMo classes moved to models.phi3_nemo name them here
__getattr__ = moved_to(__name__, "models.phi3_nemo", "Phi3Config", "Phi3Model")
