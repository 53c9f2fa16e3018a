"""A family's table is checked against both models of the config before any tensor is read; each
failure names the family's file and the table entry at fault."""

from __future__ import annotations

import pytest

from converters import qwen
from porting import proof
from porting.contract.mapping import Fused, Rename
from porting.convert.safetensors_io import SafetensorsSource
from porting.errors import PortingError


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return proof.make_hf(
        tmp_path_factory.mktemp("q3") / "hf",
        "Qwen3ForCausalLM",
        vocab_size=130,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )


def _index(table, suffix):
    return next(i for i, e in enumerate(table) if getattr(e, "mcore", "").endswith(suffix))


def _broken_tables():
    w = qwen.WEIGHTS
    k_norm = _index(w, "k_layernorm.weight")
    proj = _index(w, "linear_proj.weight")
    qkv = _index(w, "linear_qkv.weight")
    return {
        "unmapped": (
            w[:k_norm] + w[k_norm + 1 :],
            ["no entry of WEIGHTS reads HF tensor 'model.layers.0.self_attn.k_norm.weight'"],
        ),
        "mapped_twice": (
            (*w, w[proj]),
            [f"WEIGHTS[{proj}]", f"WEIGHTS[{len(w)}]", "both read HF tensor", "o_proj.weight"],
        ),
        "wrong_shape": (
            w[:qkv] + (Rename(w[qkv].hf[0], w[qkv].mcore),) + w[qkv + 1 :],
            [f"WEIGHTS[{qkv}] (Rename model.layers.*.self_attn.q_proj.weight", "(128, 64)"],
        ),
        "missing_parameter": (
            w[:qkv]
            + (Fused(w[qkv].hf, "decoder.layers.*.self_attention.qkv", w[qkv].transform),)
            + w[qkv + 1 :],
            [f"WEIGHTS[{qkv}]", "writes 'decoder.layers.0.self_attention.qkv'", "does not have"],
        ),
    }


@pytest.mark.parametrize("case", list(_broken_tables()))
def test_a_broken_table_is_named_before_any_tensor_is_read(case, qwen3, tmp_path, monkeypatch):
    table, needles = _broken_tables()[case]

    def no_reads(self, key):
        raise AssertionError(f"tensor {key} was read before the table was checked")

    monkeypatch.setattr(SafetensorsSource, "get", no_reads)
    with pytest.raises(PortingError) as err:
        proof.import_with_table(qwen3, tmp_path / "out", qwen.FAMILY, table)
    msg = str(err.value)
    assert msg.startswith(f"family qwen ({qwen.__file__}): "), msg
    for needle in needles:
        assert needle in msg, msg
