"""Completeness accounting of the mapping engine on a small synthetic table (no NeMo needed)."""

from types import SimpleNamespace

import pytest
import torch

from porting.contract.mapping import Fused, Ignore, Rename
from porting.contract.transforms import GATED_MLP
from porting.convert.mapping import export_weights, import_weights
from porting.errors import PortingError

TABLE = (
    Rename("emb", "embedding.weight"),
    Fused(("l.*.gate", "l.*.up"), "layers.*.fc1", GATED_MLP),
    Rename("head", "output.weight", when=lambda c: not c.tied),
    Ignore("l.*.inv_freq", "buffer"),
)
CTX = SimpleNamespace(tied=False)


class Source:
    def __init__(self, tensors):
        self.t = tensors

    def keys(self):
        return list(self.t)

    def get(self, k):
        return self.t[k]


def _hf():
    return {
        "emb": torch.randn(5, 3),
        "l.0.gate": torch.randn(2, 3),
        "l.0.up": torch.randn(2, 3),
        "l.1.gate": torch.randn(2, 3),
        "l.1.up": torch.randn(2, 3),
        "l.0.inv_freq": torch.randn(2),
        "head": torch.randn(5, 3),
    }


def _target():
    return {
        "embedding.weight": torch.zeros(5, 3),
        "layers.0.fc1": torch.zeros(4, 3),
        "layers.1.fc1": torch.zeros(4, 3),
        "output.weight": torch.zeros(5, 3),
    }


def test_import_then_export_is_identity():
    hf, target = _hf(), _target()
    report = import_weights(Source(hf), target, TABLE, CTX, num_layers=2)
    assert report.written == 4 and report.ignored == ["l.0.inv_freq"]
    back = dict(export_weights(target, TABLE, CTX, num_layers=2))
    assert set(back) == set(hf) - {"l.0.inv_freq"}
    assert all(torch.equal(back[k], hf[k]) for k in back)


def test_unknown_source_key_is_named():
    hf = _hf() | {"l.0.surprise": torch.zeros(1)}
    with pytest.raises(PortingError, match="l.0.surprise"):
        import_weights(Source(hf), _target(), TABLE, CTX, num_layers=2)


def test_missing_source_key_is_named():
    hf = _hf()
    del hf["l.1.up"]
    with pytest.raises(PortingError, match="missing from the checkpoint.*l.1.up"):
        import_weights(Source(hf), _target(), TABLE, CTX, num_layers=2)


def test_shape_mismatch_names_key_and_shapes():
    hf = _hf()
    hf["emb"] = torch.randn(6, 3)
    with pytest.raises(PortingError, match=r"embedding.weight.*\(6, 3\).*\(5, 3\)"):
        import_weights(Source(hf), _target(), TABLE, CTX, num_layers=2)


def test_dtype_mismatch_is_an_error():
    hf = _hf()
    hf["emb"] = hf["emb"].to(torch.bfloat16)
    with pytest.raises(PortingError, match="dtype mismatch for 'embedding.weight'"):
        import_weights(Source(hf), _target(), TABLE, CTX, num_layers=2)


def test_unwritten_target_parameter_is_an_error():
    target = _target() | {"layers.0.norm": torch.zeros(3)}
    with pytest.raises(PortingError, match="not written.*layers.0.norm"):
        import_weights(Source(_hf()), target, TABLE, CTX, num_layers=2)


def test_when_false_entry_leaves_key_unclaimed():
    tied = SimpleNamespace(tied=True)
    target = _target()
    del target["output.weight"]
    with pytest.raises(PortingError, match="'head'"):
        import_weights(Source(_hf()), target, TABLE, tied, num_layers=2)


def test_export_refuses_unused_megatron_parameter():
    target = _target() | {"extra.weight": torch.zeros(1)}
    with pytest.raises(PortingError, match="no HF destination.*extra.weight"):
        list(export_weights(target, TABLE, CTX, num_layers=2))


def test_attention_entries_store_each_bias_as_asked():
    """``attention``: q/k/v fused by ``QKV`` into ``linear_qkv`` and ``o_proj`` renamed, each bias
    left out (False), always stored (True) or stored where its predicate holds."""
    from porting.contract.mapping import attention
    from porting.contract.transforms import QKV

    plain = attention("a.", "m.")
    assert [type(e) for e in plain] == [Fused, Rename]
    assert plain[0].hf == ("a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight")
    assert plain[0].mcore == "m.linear_qkv.weight" and plain[0].transform is QKV
    assert (plain[1].hf, plain[1].mcore) == ("a.o_proj.weight", "m.linear_proj.weight")

    biased = attention("a.", "m.", qkv_bias=True, proj_bias=True)
    assert [e.mcore for e in biased] == [
        "m.linear_qkv.weight", "m.linear_qkv.bias", "m.linear_proj.weight", "m.linear_proj.bias"
    ]  # fmt: skip
    assert biased[1].hf == ("a.q_proj.bias", "a.k_proj.bias", "a.v_proj.bias")
    assert all(e.when is None for e in biased)

    def when(c):
        return c.bias

    def dense(c, i):
        return i == 0

    only_qkv = attention("a.", "m.", qkv_bias=when, layers=dense)
    assert [e.mcore for e in only_qkv] == [
        "m.linear_qkv.weight", "m.linear_qkv.bias", "m.linear_proj.weight"
    ]  # fmt: skip
    assert only_qkv[1].when is when and only_qkv[0].when is None
    assert all(e.layers is dense for e in only_qkv)
