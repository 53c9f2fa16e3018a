"""OLMo 2's and OLMoE's attention as Megatron-Core modules (no NeMo needed): q/k RMSNorm over the
whole projection, and OLMoE's optional clamp of q, k and v.

HF (``transformers`` 4.57, ``Olmo2Attention`` / ``OlmoeAttention``) norms ``q_proj(x)`` over all
``heads x head_dim`` channels and ``k_proj(x)`` over all ``kv_heads x head_dim``, before splitting
into heads and before the rotary embedding. Megatron's ``qk_layernorm`` norms each head apart (over
``head_dim``, Qwen3's), a different function: the RMS of one head is not the RMS of all of them.

Under tensor parallelism each rank holds a contiguous run of heads (Megatron's fused QKV groups
query heads with their KV head, in HF's head order), so the norm weight is sharded with the heads
and the mean square is the sum of squares all-reduced over the tensor-parallel group, divided by
the full width. The reduction is autograd's (``torch.distributed.nn``): every rank's output depends
on every rank's input through it, so its gradient is all-reduced too.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_size


class RMSNorm(torch.nn.Module):
    """``x / rms(x) * w`` in fp32, cast back to ``x``'s dtype, as HF's ``Olmo2RMSNorm`` (plain
    ``w``, not Gemma's ``1 + w``). Megatron's local norm does not promote a bf16 input to fp32."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def mean_square(self, h: torch.Tensor) -> torch.Tensor:
        """The mean of ``h**2`` over the normed width (fp32)."""
        return h.pow(2).mean(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` normed over its last dimension; same dtype as ``x``."""
        h = x.float()
        h = h * torch.rsqrt(self.mean_square(h) + self.eps)
        return (self.weight * h).to(x.dtype)


class HeadShardedRMSNorm(RMSNorm):
    """:class:`RMSNorm` over the last dimension of ``width`` channels, of which this rank holds
    ``width / tp`` (its heads): the weight is the rank's slice, the mean square the whole width's."""

    def __init__(self, config, width: int, tp_group, eps: float) -> None:
        self.tp_group = tp_group
        self.tp_size = get_pg_size(tp_group)
        super().__init__(config, width // self.tp_size, eps)
        self.weight.sequence_parallel = False  # split by heads, never replicated along the sequence
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def mean_square(self, h: torch.Tensor) -> torch.Tensor:
        """Sum of squares over every rank's heads, over the full width (fp32)."""
        squares = h.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            squares = torch.distributed.nn.functional.all_reduce(squares, group=self.tp_group)
        return squares / (h.shape[-1] * self.tp_size)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight sharded along its only axis over the tensor-parallel ranks, as
        ``ColumnParallelLinear``'s rows (a checkpoint holds the whole HF width)."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


class FullQKNormSelfAttention(SelfAttention):
    """``SelfAttention`` with OLMo's q/k norms: ``q = q_layernorm(x Wq)`` over all query heads and
    ``k = k_layernorm(x Wk)`` over all KV heads (:class:`HeadShardedRMSNorm`), then, where
    ``config.clip_qkv`` is set, q, k and v clamped to ``[-clip_qkv, clip_qkv]`` (OLMoE's
    ``clamp_`` after the norms), before the rotary embedding. The spec's ``q_layernorm`` and
    ``k_layernorm`` are not used: these norms are this class's own, keeping the stock names."""

    def __init__(self, config, submodules, *args, **kwargs) -> None:
        plain = dataclasses.replace(submodules, q_layernorm=None, k_layernorm=None)
        super().__init__(config, plain, *args, **kwargs)
        tp, eps = self.pg_collection.tp, config.layernorm_epsilon
        self.q_layernorm = HeadShardedRMSNorm(config, self.query_projection_size, tp, eps)
        self.k_layernorm = HeadShardedRMSNorm(config, self.kv_projection_size, tp, eps)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True
    ):
        """``(query [sq, b, np, hn], key [sq, b, ng, hn], value [sq, b, ng, hn])`` of this rank.
        ``output_gate`` is Megatron-Core 0.19's gated attention, which OLMo does not have."""
        assert split_qkv, "the full-width q/k norm needs q and k apart"
        assert not output_gate, "OLMo's attention has no output gate"
        # [sq, b, ng, (np/ng + 2) * hn], split into the groups' queries, key and value
        mixed, split = super().get_query_key_value_tensors(hidden_states, split_qkv=False)
        query, key, value = torch.split(mixed, split, dim=3)
        sq, b = mixed.shape[:2]
        # groups then their heads is HF's head order: [sq, b, np * hn] and [sq, b, ng * hn]
        query = self.q_layernorm(query.reshape(sq, b, -1))
        key = self.k_layernorm(key.reshape(sq, b, -1))
        if self.clip_qkv is not None:
            query, key, value = (
                t.clamp(-self.clip_qkv, self.clip_qkv) for t in (query, key, value)
            )
        hn = self.hidden_size_per_attention_head
        return query.view(sq, b, -1, hn), key.view(sq, b, -1, hn), value
