"""Granite MoE family: the full proof (porting.proof) on tiny random-init models with Granite's
multipliers and stacked experts, routing checked token by token, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). q and
k are sharpened as in tests/test_granite.py, and the routers' logits spread 8 times wider
(porting.proof.sharpened).
"""

from __future__ import annotations

import pytest

from converters import granitemoe
from porting import proof

LAYERS = 3
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    num_local_experts=4,
)
VARIANTS = {
    # granite-3.0-3b-a800m's multipliers on a tiny model
    "granite3_moe": dict(
        num_key_value_heads=2, tie_word_embeddings=True, num_experts_per_tok=2,
        attention_multiplier=0.015625, embedding_multiplier=12.0, residual_multiplier=0.22,
        logits_scaling=6.0,
    ),
    "untied": dict(
        num_key_value_heads=4, num_experts_per_tok=3, head_dim=32, attention_multiplier=0.05,
        embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(
            d,
            "GraniteMoeForCausalLM",
            seed=len(v),
            edit=proof.sharpened(routers=8),
            **COMMON,
            **VARIANTS[v],
        ),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_routing_matches_transformers_token_by_token(variant, converted):
    proof.prove_routing(*converted(variant), "block_sparse_moe.router.layer")


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in VARIANTS], tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


# On the variant of milder multipliers: the published ones (residual 0.22, logits / 6) leave a tiny
# model's logits under 0.3, where a router scaled by 1.5 moves them by 8e-6 (it reorders no expert
# and only reweighs the chosen ones) and an expert's planted fault by under 1e-3.
def test_planted_fault_is_named(converted, tmp_path):
    hf, _ = converted("untied")
    proof.prove_fault_named(hf, tmp_path / "ck", granitemoe.FAMILY, 1, LAYERS, "linear_fc1.weight")


def test_swapped_experts_are_named(converted, tmp_path):
    hf, _ = converted("untied")
    table = proof.swapped_experts_table(granitemoe.FAMILY.weights, 2, 0, 3, LAYERS, 4)
    proof.prove_table_fault_named(hf, tmp_path / "ck", granitemoe.FAMILY, table, 2)


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"attention_bias": True}, ["attention_bias=true", "no expert"]),
        ({"num_experts_per_tok": 5}, ["num_experts_per_tok=5", "num_local_experts=4"]),
        ({"logits_scaling": -1.0}, ["logits_scaling=-1.0"]),
        ({"num_experts_per_tok": 1}, ["num_experts_per_tok=1", "exactly 1"]),
        ({"model_type": "granite"}, ["model_type='granite'"]),
    ],
    ids=["attention_bias", "topk", "negative_scale", "top1", "model_type"],
)
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("granite3_moe")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


def test_every_mapped_feature_is_seen_or_named(converted):
    seen, report = proof.prove_features_named(*converted("granite3_moe"))
    assert report.passed and report.unobserved == []
    assert {"attention_multiplier", "residual_multiplier", "logits_scaling"} <= set(seen.observed)
