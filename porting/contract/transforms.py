"""Layout transforms between Hugging Face and Megatron-Core tensors, each paired with its inverse.

Every transform is a small pure function with explicit keyword shape arguments. A
:class:`TransformPair` bundles a forward (HF -> Megatron) function and its inverse so that a mapping
table entry names one object and export is derived from import, never written twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from porting.errors import PortingError

if TYPE_CHECKING:  # the contract imports no torch: a family's tables load for a listing
    import torch


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    import torch

    return torch.cat(tensors, dim=dim)


def interleave_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_query_groups: int,
    head_dim: int,
) -> torch.Tensor:
    """Fuse separate q/k/v projections into Megatron's grouped ``linear_qkv`` layout.

    Megatron-Core (``megatron/core/transformer/attention.py``, ``SelfAttention.get_query_key_value_tensors``)
    reads ``linear_qkv`` as ``[ng, (np/ng + 2) * hn, ...]``: for each query group, its ``np/ng`` query
    heads, then its key head, then its value head. Works for weights ``[out, in]`` and biases ``[out]``.
    """
    if num_heads % num_query_groups:
        raise PortingError(
            f"num_query_groups={num_query_groups} does not divide num_heads={num_heads}"
        )
    heads_per_group = num_heads // num_query_groups
    rest = q.shape[1:]
    expected = {
        "q": (num_heads * head_dim, *rest),
        "k": (num_query_groups * head_dim, *rest),
        "v": (num_query_groups * head_dim, *rest),
    }
    for name, t in (("q", q), ("k", k), ("v", v)):
        if tuple(t.shape) != expected[name]:
            raise PortingError(
                f"{name} has shape {tuple(t.shape)}, expected {expected[name]} for "
                f"num_heads={num_heads}, num_query_groups={num_query_groups}, head_dim={head_dim}"
            )
    # q: [np*hn, ...] -> [ng, np/ng*hn, ...]; k, v: [ng*hn, ...] -> [ng, hn, ...]
    q = q.reshape(num_query_groups, heads_per_group * head_dim, *rest)
    k = k.reshape(num_query_groups, head_dim, *rest)
    v = v.reshape(num_query_groups, head_dim, *rest)
    # [ng, (np/ng + 2)*hn, ...] -> [ng*(np/ng + 2)*hn, ...]
    return _cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor,
    *,
    num_heads: int,
    num_query_groups: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_qkv`: Megatron ``linear_qkv`` back to separate q, k, v."""
    heads_per_group = num_heads // num_query_groups
    rest = qkv.shape[1:]
    # [ng*(np/ng + 2)*hn, ...] -> [ng, (np/ng + 2)*hn, ...]
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *rest).contiguous(),
        k.reshape(num_query_groups * head_dim, *rest).contiguous(),
        v.reshape(num_query_groups * head_dim, *rest).contiguous(),
    )


def concat_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Stack HF ``gate_proj`` and ``up_proj`` into Megatron's gated ``linear_fc1`` ([gate; up] on dim 0).

    Megatron-Core's gated MLP (``megatron/core/transformer/mlp.py``, ``glu``) chunks fc1's output in
    two along the last dim and applies the activation to the first half.
    """
    if gate.shape != up.shape:
        raise PortingError(f"gate/up shapes differ: {tuple(gate.shape)} vs {tuple(up.shape)}")
    return _cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`concat_gate_up`."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(weight: torch.Tensor, *, padded_vocab_size: int) -> torch.Tensor:
    """Pad embedding / output rows up to Megatron's padded vocabulary with zero rows.

    Zero rows keep the padded logits at exactly 0 (untied output) so they never win an argmax over
    real tokens by chance; they are removed exactly by :func:`unpad_vocab`.
    """
    vocab = weight.shape[0]
    if padded_vocab_size < vocab:
        raise PortingError(f"padded vocabulary {padded_vocab_size} is smaller than {vocab}")
    if padded_vocab_size == vocab:
        return weight
    from porting import pages

    out = weight.new_empty((padded_vocab_size, *weight.shape[1:]))
    out[vocab:].zero_()
    # a block at a time, each block of a mapped table released once copied: a 202,048-row
    # table is otherwise resident twice, its file's pages and the copy
    pages.copy_rows(out[:vocab], weight)
    return out


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)`` in bounded memory: two tables read from mapped files compared a
    block of rows at a time, each block's pages released once compared (a family checking a
    copy it reads against the model's, as DeepSeek's MTP layer's embedding)."""
    from porting import pages

    return pages.equal_rows(a, b)


def unpad_vocab(weight: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Remove exactly the rows :func:`pad_vocab` added."""
    return weight[:vocab_size].contiguous()


@dataclass(frozen=True)
class TransformPair:
    """A forward transform (HF tensors -> one Megatron tensor) and its inverse.

    ``forward(*hf_tensors, ctx)`` returns the Megatron tensor; ``inverse(tensor, ctx)`` returns a tuple
    of HF tensors in the entry's order. ``ctx`` is the family's shape context (an object with the
    attributes the transform needs, e.g. ``num_heads``).
    """

    name: str
    forward: Callable[..., torch.Tensor]
    inverse: Callable[[torch.Tensor, Any], tuple[torch.Tensor, ...]]


IDENTITY = TransformPair("identity", lambda t, ctx: t, lambda t, ctx: (t,))

# one expert's slice of a stack that HF multiplies as ``x @ w`` (gpt-oss's and Llama 4's
# ``down_proj``, ``(ffn, hidden)``) into the ``(out, in)`` weight a Megatron linear holds
TRANSPOSE = TransformPair(
    "transpose",
    lambda t, ctx: t.transpose(0, 1).contiguous(),
    lambda t, ctx: (t.transpose(0, 1).contiguous(),),
)

QKV = TransformPair(
    "qkv_interleave",
    lambda q, k, v, ctx: interleave_qkv(
        q,
        k,
        v,
        num_heads=ctx.num_heads,
        num_query_groups=ctx.num_query_groups,
        head_dim=ctx.head_dim,
    ),
    lambda t, ctx: split_qkv(
        t,
        num_heads=ctx.num_heads,
        num_query_groups=ctx.num_query_groups,
        head_dim=ctx.head_dim,
    ),
)

GATED_MLP = TransformPair(
    "gate_up_concat",
    lambda gate, up, ctx: concat_gate_up(gate, up),
    lambda t, ctx: split_gate_up(t),
)

VOCAB_PAD = TransformPair(
    "vocab_pad",
    lambda t, ctx: pad_vocab(t, padded_vocab_size=ctx.padded_vocab_size),
    lambda t, ctx: (unpad_vocab(t, vocab_size=ctx.vocab_size),),
)
