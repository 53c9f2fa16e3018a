"""Granite family: the full proof (porting.proof) on tiny random-init models whose multipliers are
the published ones, each multiplier pinned by a negative control and seen by the gate, and the
configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). q and
k are sharpened (porting.proof.sharpened): at the published attention multiplier a random init's
attention is uniform, and the scale and rope_theta would move its logits by under 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from converters import granite
from porting import proof

LAYERS = 3
# granite-3.1-8b's multipliers (tests/published_configs.py) on a tiny model
MULTIPLIERS = dict(
    attention_multiplier=0.0078125,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    logits_scaling=16.0,
)
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
VARIANTS = {
    "granite3": dict(num_key_value_heads=2, tie_word_embeddings=True, **MULTIPLIERS),
    "untied_biases": dict(
        num_key_value_heads=4, attention_bias=True, mlp_bias=True, head_dim=32,
        attention_multiplier=0.05, embedding_multiplier=3.0, residual_multiplier=0.5,
        logits_scaling=2.0,
    ),
    "granite3_bf16": dict(
        num_key_value_heads=2, tie_word_embeddings=True, dtype=torch.bfloat16, **MULTIPLIERS
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(
            d, "GraniteForCausalLM", seed=len(v), edit=proof.sharpened(), **COMMON, **VARIANTS[v]
        ),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("granite3", "untied_biases")], tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    proof.prove_formats(converted("granite3")[0], tmp_path)


def test_planted_fault_is_named(converted, tmp_path):
    hf, _ = converted("untied_biases")
    proof.prove_fault_named(hf, tmp_path / "ck", granite.FAMILY, 1, LAYERS, "mlp.linear_fc2.bias")


@pytest.mark.parametrize(
    "field", ["softmax_scale", "embedding_multiplier", "residual_multiplier", "logits_scaling"]
)
def test_each_multiplier_is_needed(field, converted):
    """Negative controls: the checkpoint run with one multiplier at its neutral value (the usual
    attention scale for ``softmax_scale``) moves the logits far past the tolerance."""
    from porting.parity import harness

    hf_dir, ckpt = converted("granite3")
    prompts = proof.prompts_of(ckpt)
    mc = proof.megatron_logits_with(
        ckpt, prompts, **{field: None if field == "softmax_scale" else 1.0}
    )
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 100 * proof.ATOL


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"logits_scaling": 0}, ["logits_scaling=0", "> 0"]),
        ({"residual_multiplier": "0.22"}, ["residual_multiplier='0.22'"]),
        ({"head_dim": None}, ["head_dim=None", "GraniteAttention"]),
        ({"model_type": "llama"}, ["model_type='llama'"]),
        ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
        ({"attention_bias": True}, ["attention_bias=True", "mlp_bias=False"]),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["dynamic"]),
    ],
    ids=["zero_logit_scale", "string_multiplier", "head_dim_null", "model_type", "activation",
         "bias_mix", "dynamic"],
)  # fmt: skip
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("granite3")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", ["granite3", "untied_biases"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each multiplier and rope_theta, perturbed on the HF side alone, moves the gate's logits
    past its tolerance, or the gate's report names it."""
    seen, report = proof.prove_features_named(*converted(variant))
    assert report.passed and report.unobserved == []
    assert set(granite.MULTIPLIERS) <= set(seen.observed)
