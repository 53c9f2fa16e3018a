"""Each transform pair on GQA/MQA/MHA shapes: the forward layout is Megatron's, the inverse undoes it."""

import pytest
import torch

from porting.contract.transforms import (
    concat_gate_up,
    interleave_qkv,
    pad_vocab,
    split_gate_up,
    split_qkv,
    unpad_vocab,
)
from porting.errors import PortingError


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 1), (4, 4), (8, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_interleave_layout_and_inverse(heads, groups, bias):
    hn, h = 3, 10
    shape = (lambda n: (n * hn,)) if bias else (lambda n: (n * hn, h))
    q, k, v = torch.randn(shape(heads)), torch.randn(shape(groups)), torch.randn(shape(groups))
    fused = interleave_qkv(q, k, v, num_heads=heads, num_query_groups=groups, head_dim=hn)
    assert fused.shape[0] == (heads + 2 * groups) * hn
    # Megatron's reading (attention.py): per group, np/ng query heads, one key head, one value head.
    per = heads // groups
    grouped = fused.reshape(groups, (per + 2) * hn, *fused.shape[1:])
    for g in range(groups):
        for j in range(per):
            head = g * per + j
            torch.testing.assert_close(
                grouped[g, j * hn : (j + 1) * hn], q[head * hn : (head + 1) * hn], rtol=0, atol=0
            )
        torch.testing.assert_close(
            grouped[g, per * hn : (per + 1) * hn], k[g * hn : (g + 1) * hn], rtol=0, atol=0
        )
        torch.testing.assert_close(
            grouped[g, (per + 1) * hn :], v[g * hn : (g + 1) * hn], rtol=0, atol=0
        )
    q2, k2, v2 = split_qkv(fused, num_heads=heads, num_query_groups=groups, head_dim=hn)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)


def test_plain_concat_differs_from_interleave_for_gqa():
    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    fused = interleave_qkv(q, k, v, num_heads=4, num_query_groups=2, head_dim=3)
    assert not torch.equal(fused, torch.cat([q, k, v]))


def test_gate_up_roundtrip_and_order():
    gate, up = torch.randn(7, 4), torch.randn(7, 4)
    fc1 = concat_gate_up(gate, up)
    assert torch.equal(fc1[:7], gate) and torch.equal(fc1[7:], up)
    g2, u2 = split_gate_up(fc1)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_gate_up_shape_mismatch_is_an_error():
    with pytest.raises(PortingError, match="gate/up shapes differ"):
        concat_gate_up(torch.randn(7, 4), torch.randn(6, 4))


def test_vocab_pad_is_exactly_removed():
    w = torch.randn(130, 8)
    p = pad_vocab(w, padded_vocab_size=256)
    assert p.shape == (256, 8) and torch.equal(p[130:], torch.zeros(126, 8))
    assert torch.equal(unpad_vocab(p, vocab_size=130), w)
    assert pad_vocab(w, padded_vocab_size=130) is w
    with pytest.raises(PortingError):
        pad_vocab(w, padded_vocab_size=128)
