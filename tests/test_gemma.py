"""Gemma family (Gemma, Gemma 2): the full proof (porting.proof) on tiny random-init models, each
Gemma-specific piece pinned by a negative control, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). The
soft-caps are set low (0.05 on scores, 0.2 on logits) so that tanh bends these tiny models'
scores (~0.03) and logits (~0.2); at Gemma 2's own 50 and 30 a dropped cap would hide inside the
tolerance.
"""

from __future__ import annotations

import pytest
import torch

from converters import gemma
from porting import proof

COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
)
GEMMA2 = dict(
    num_key_value_heads=2,
    head_dim=32,
    sliding_window=8,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=0.05,
    final_logit_softcapping=0.2,
)
VARIANTS = {
    "gemma_mqa": ("GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=32)),
    "gemma_mha_erf": (
        "GemmaForCausalLM",
        dict(num_key_value_heads=4, head_dim=16, hidden_act="gelu"),
    ),
    "gemma2": ("Gemma2ForCausalLM", GEMMA2),
    "gemma2_untied_nocap": (
        "Gemma2ForCausalLM",
        GEMMA2
        | dict(
            tie_word_embeddings=False, attn_logit_softcapping=None, final_logit_softcapping=None
        ),
    ),
    "gemma2_bf16": ("Gemma2ForCausalLM", GEMMA2 | dict(dtype=torch.bfloat16)),
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


@pytest.mark.parametrize(
    "variant,changes",
    [
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma2", {"window_attn_skip_freq": [1, 1, 1]}),
        ("gemma2", {"window_size": (8, 0)}),
        ("gemma2", {"softmax_scale": None}),
    ],
    ids=[
        "no_attn_softcap",
        "no_final_softcap",
        "every_layer_windowed",
        "window_one_wider",
        "head_dim_scale",
    ],
)
def test_each_gemma_piece_matters(variant, changes, converted):
    """The checkpoint run with one piece changed must fail parity: each one is really exercised."""
    from porting.parity import harness

    hf_dir, ckpt = converted(variant)
    prompts = proof.prompts_of(ckpt)
    mc = proof.megatron_logits_with(ckpt, prompts, **changes)
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 1e-3


def test_the_variants_build_what_they_claim(converted):
    """GELU flavour, norms and caps per variant (tanh and erf GELU differ by less than the
    tolerance on these tiny activations, so parity alone would not tell them apart)."""
    from models.gemma import gelu_erf, gelu_tanh
    from models.gemma_spec import GemmaRMSNorm, PostNormRowParallelLinear
    from porting.convert.megatron import init_parallel
    from porting.testing import load_checkpoint_model

    init_parallel()
    expected = {
        "gemma_mqa": (gelu_tanh, False, None),
        "gemma_mha_erf": (gelu_erf, False, None),
        "gemma2": (gelu_tanh, True, 0.2),
        "gemma2_untied_nocap": (gelu_tanh, True, None),
    }
    for variant, (act, sandwich, final_cap) in expected.items():
        model, config = load_checkpoint_model(converted(variant)[1])
        assert config.activation_func is act, variant
        layer = model.decoder.layers[0]
        assert isinstance(layer.input_layernorm, GemmaRMSNorm), variant
        assert isinstance(model.decoder.final_layernorm, GemmaRMSNorm), variant
        assert isinstance(layer.self_attention.linear_proj, PostNormRowParallelLinear) == sandwich
        assert config.final_logit_softcapping == final_cap, variant


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    # MQA (one KV head) cannot be split over two ranks in Megatron; GQA and MHA can
    proof.prove_tp2([converted(v)[1] for v in ("gemma_mha_erf", "gemma2")], tmp_path)


@pytest.mark.parametrize(
    "variant", ["gemma_mha_erf", "gemma2", "gemma2_untied_nocap", "gemma2_bf16"]
)
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    """Both Megatron layouts; the Bridge layout names the family's own provider
    (models.gemma_bridge), which Bridge's loader builds: tests/test_owners.py."""
    proof.prove_formats(converted("gemma2")[0], tmp_path)
    run_config = (tmp_path / "megatron-bridge" / "iter_0000000" / "run_config.yaml").read_text()
    assert "_target_: models.gemma_bridge.GemmaModelProvider\n" in run_config


@pytest.mark.parametrize(
    "variant,pattern",
    [
        ("gemma2", "linear_proj.post_layernorm.weight"),
        ("gemma2", "linear_fc2.post_layernorm.weight"),
        ("gemma_mqa", "pre_mlp_layernorm.weight"),
    ],
)
def test_planted_fault_is_named(variant, pattern, converted, tmp_path):
    hf, _ = converted(variant)
    proof.prove_fault_named(hf, tmp_path / "ck", gemma.FAMILY, 1, 3, pattern)


@pytest.mark.parametrize(
    "variant,changes,needles",
    [
        ("gemma2", {"attention_bias": True}, ["attention_bias=True", "o_proj"]),
        ("gemma2", {"hidden_activation": "relu"}, ["hidden_activation='relu'"]),
        ("gemma2", {"layer_types": ["sliding_attention"]}, ["layer_types", "3 layers"]),
        ("gemma2", {"sliding_window": None}, ["sliding_window is null"]),
        ("gemma2", {"attn_logit_softcapping": 0}, ["attn_logit_softcapping=0"]),
        ("gemma_mqa", {"query_pre_attn_scalar": 24}, ["Gemma 2 fields"]),
        ("gemma_mqa", {"model_type": "gemma2"}, ["model_type='gemma2'"]),
        ("gemma_mqa", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ["rope_scaling"]),
    ],
    ids=[
        "o_bias",
        "relu",
        "layer_types_short",
        "null_window",
        "zero_cap",
        "gemma2_field_in_gemma",
        "model_type",
        "rope_scaling",
    ],
)
def test_config_lint_names_the_field(variant, changes, needles, converted, tmp_path):
    err = proof.refused_import(converted(variant)[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each of the variant's features (window, caps, GELU variant, rope, softmax scale), perturbed
    on the HF side alone, moves the gate's logits past 1e-5, or the gate's report names it."""
    seen, report = proof.prove_features_named(*converted(variant))
    assert report.passed and seen.observed
    if variant in ("gemma2", "gemma2_bf16"):  # the low caps and the window of 8 are in reach
        assert {"attn_logit_softcapping", "final_logit_softcapping", "sliding_window"} <= set(
            seen.observed
        )
