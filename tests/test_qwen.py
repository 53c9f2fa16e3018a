"""Qwen family (Qwen2, Qwen3): the full proof (porting.proof) on tiny random-init models, and the
configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity).
"""

from __future__ import annotations

import pytest
import torch

from converters import qwen
from porting import proof

COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,  # even: split by tensor parallel 2
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
VARIANTS = {
    "qwen2_tied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2_untied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1e6)),
    # head_dim 32 is apart from hidden/heads (16), as in the released Qwen3 sizes
    "qwen3_tied": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3_untied": ("Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=16)),
    "qwen3_bf16": ("Qwen3ForCausalLM", dict(head_dim=32, dtype=torch.bfloat16)),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(d, VARIANTS[v][0], seed=len(v), **COMMON, **VARIANTS[v][1]),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def test_the_variants_build_what_they_claim(converted):
    from porting.testing import checkpoint_config

    for variant, (arch, fields) in VARIANTS.items():
        config = checkpoint_config(converted(variant)[1])
        assert config.add_qkv_bias == (arch == "Qwen2ForCausalLM"), variant
        assert config.qk_layernorm == (arch == "Qwen3ForCausalLM"), variant
        assert config.add_bias_linear is False
        assert config.kv_channels == fields.get("head_dim", 16), variant


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("qwen2_untied", "qwen3_tied")], tmp_path)


@pytest.mark.parametrize("variant", ["qwen2_tied", "qwen3_untied", "qwen3_bf16"])
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    proof.prove_formats(converted("qwen3_untied")[0], tmp_path)


@pytest.mark.parametrize(
    "variant,pattern",
    [("qwen2_untied", "linear_qkv.bias"), ("qwen3_tied", "k_layernorm.weight")],
)
def test_planted_fault_is_named(variant, pattern, converted, tmp_path):
    """A Qwen-only tensor (the q/k/v bias, the key norm) wrong in layer 1 fails parity there."""
    hf, _ = converted(variant)
    proof.prove_fault_named(hf, tmp_path / "ck", qwen.FAMILY, 1, 3, pattern)


@pytest.mark.parametrize(
    "variant,changes,needles",
    [
        (
            "qwen2_tied",
            {"use_sliding_window": True},
            ["use_sliding_window=True", "max_window_layers"],
        ),
        (
            "qwen2_tied",
            {"layer_types": ["sliding_attention", "full_attention", "full_attention"]},
            ["layer_types", "sliding_attention"],
        ),
        ("qwen3_tied", {"attention_bias": True}, ["attention_bias=True", "o_proj"]),
        ("qwen2_tied", {"attention_bias": False}, ["attention_bias is not a Qwen2 field"]),
        ("qwen2_tied", {"model_type": "qwen3"}, ["model_type='qwen3'", "Qwen2ForCausalLM"]),
        ("qwen2_tied", {"hidden_act": "gelu"}, ["hidden_act='gelu'", "SwiGLU"]),
        (
            "qwen3_tied",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            ["rope_scaling", "dynamic"],
        ),
        ("qwen3_tied", {"q_lora_rank": 8}, ["unsupported field", "q_lora_rank"]),
    ],
    ids=[
        "sliding_window",
        "sliding_layer_types",
        "qwen3_o_bias",
        "qwen2_attention_bias",
        "model_type_mismatch",
        "gelu",
        "dynamic",
        "unknown_field",
    ],
)
def test_config_lint_names_the_field(variant, changes, needles, converted, tmp_path):
    err = proof.refused_import(converted(variant)[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each mapped feature (rope_theta, a window, ...), perturbed on the HF side alone, moves the
    gate's logits past its tolerance, or the gate's report names it."""
    _, report = proof.prove_features_named(*converted(variant)[:2])
    assert report.passed
