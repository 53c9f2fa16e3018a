"""Phi-3 family (``Phi3ForCausalLM``): the full proof (porting.proof) on tiny random-init models,
the fused projections, the window, partial rotary and LongRoPE pinned by negative controls, and the
configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). The
LongRoPE variants have ``original_max_position_embeddings`` 160 under 4096 positions (attention
factor sqrt(1 + ln 25.6 / ln 160) = 1.28), so the gate's prompts (3 to 133 tokens, and the streamed gate's
padded batch) run on the short table, as a published checkpoint's do; the long table is proven on
a prompt of 200 tokens (:func:`test_long_table_parity`). A prompt's table depends on its own
length: the whole-model and streamed logits agree only where prompts and padded batch select the
same table, which is why no gate prompt passes 160.
"""

from __future__ import annotations

import math

import pytest
import torch

from converters import phi3
from porting import proof

COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    original_max_position_embeddings=256,
)


def _longrope(pairs: int) -> dict:
    return {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.0 + 0.9 * i for i in range(pairs)],
    }


VARIANTS = {
    # Phi-3-mini-4k's layout: MHA, a sliding window
    "mini_window": dict(num_key_value_heads=4, sliding_window=8),
    # Phi-4-mini's layout without LongRoPE: GQA, partial rotary, tied output
    "gqa_partial_tied": dict(
        num_key_value_heads=2, partial_rotary_factor=0.5, tie_word_embeddings=True
    ),
    # Phi-3-mini-128k / Phi-3.5-mini: LongRoPE on the whole head
    "longrope": dict(
        num_key_value_heads=2,
        max_position_embeddings=4096,
        original_max_position_embeddings=160,
        rope_scaling=_longrope(8),
    ),
    # Phi-4-mini: LongRoPE on 3/4 of the head (cos and sin scaled on the rotated channels only)
    "longrope_partial": dict(
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
        max_position_embeddings=4096,
        original_max_position_embeddings=160,
        rope_scaling=_longrope(6),
        tie_word_embeddings=True,
    ),
    "window_bf16": dict(num_key_value_heads=2, sliding_window=8, dtype=torch.bfloat16),
}


def _partial_off(config):
    # under LongRoPE the factor lists are as long as the rotated width: no other width runs
    f = getattr(config, "partial_rotary_factor", 1.0)
    return None if f == 1.0 or config.rope_scaling else {"partial_rotary_factor": 1.0}


def _original_halved(config):
    return None if config.rope_scaling is None else {"original_max_position_embeddings": 80}


FEATURES = proof.FEATURES | {
    "partial_rotary_factor": _partial_off,
    "original_max_position_embeddings": _original_halved,
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(d, "Phi3ForCausalLM", seed=len(v), **(COMMON | VARIANTS[v])),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def _with_long_prompt(ckpt) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [*proof.prompts_of(ckpt), torch.randint(0, 120, (1, 200), generator=g)]


@pytest.mark.parametrize("variant", ["longrope", "longrope_partial"])
def test_long_table_parity(variant, converted):
    """Past original_max_position_embeddings both sides switch to the long factors: full-logit
    parity on the gate's prompts plus one of 200 tokens, each run alone."""
    hf_dir, ckpt = converted(variant)
    proof.assert_parity(*proof.logits(hf_dir, ckpt, _with_long_prompt(ckpt)))


def test_the_gate_names_the_long_table_its_prompts_never_reach(converted):
    """The gate's prompts stop short of original_max_position_embeddings (160 here, 4096 on the
    128k releases): the long factors are never used there, and the report says so."""
    from porting.parity import harness

    report = harness.verify(*converted("longrope"), atol=proof.ATOL, rtol=proof.RTOL)
    assert report.passed, report.summary()
    named = {u["field"]: u["why"] for u in report.unobserved}
    assert "long_factor" in named.get("rope_scaling", ""), report.unobserved
    assert "original_max_position_embeddings=160" in named["rope_scaling"]


@pytest.mark.parametrize(
    "variant,changes",
    [
        ("mini_window", {"window_size": None}),
        ("mini_window", {"window_size": (8, 0)}),
        ("gqa_partial_tied", {"rotary_percent": 1.0}),
        ("longrope", {"longrope_long_factor": _longrope(8)["short_factor"]}),
        ("longrope", {"longrope_short_factor": _longrope(8)["long_factor"]}),
        ("longrope", {"yarn_rotary_scaling_factor": 1.0}),
        (
            "longrope_partial",
            {
                "yarn_rotary_scaling_factor": 1.0,
                "softmax_scale": (1 + math.log(25.6) / math.log(160)) / 4,
            },
        ),
    ],
    ids=[
        "no_window",
        "window_one_wider",
        "whole_head_rotated",
        "long_table_never_used",
        "short_table_never_used",
        "no_attention_factor",
        "attention_factor_as_softmax_scale",
    ],
)
def test_each_phi3_piece_matters(variant, changes, converted):
    """The checkpoint run with one piece changed must fail parity: each one is really exercised
    (the last: 1.28^2 / sqrt(16) on every score also scales the unrotated channels)."""
    from porting.parity import harness

    hf_dir, ckpt = converted(variant)
    prompts = _with_long_prompt(ckpt)
    mc = proof.megatron_logits_with(ckpt, prompts, **changes)
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 1e-3


def test_fused_projections_round_trip_exactly():
    """The fused qkv transform on a GQA shape: interleaved per group, and back bit for bit."""
    from porting.contract.family import ShapeContext

    ctx = ShapeContext(3, 64, 4, 2, 16, 130, 256, False)
    fused = torch.randn(4 * 16 + 2 * 2 * 16, 64)
    mc = phi3.FUSED_QKV.forward(fused, ctx)
    q, k, v = fused.split([64, 32, 32])
    # group 0: heads 0, 1, then k0, v0
    assert torch.equal(mc[:32], q[:32]) and torch.equal(mc[32:48], k[:16])
    assert torch.equal(mc[48:64], v[:16])
    (back,) = phi3.FUSED_QKV.inverse(mc, ctx)
    assert torch.equal(back, fused)


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2(
        [converted(v)[1] for v in ("mini_window", "longrope_partial", "gqa_partial_tied")], tmp_path
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


@pytest.mark.parametrize(
    "variant,pattern",
    [
        ("longrope", "self_attention.linear_qkv.weight"),
        ("mini_window", "mlp.linear_fc1.weight"),
    ],
)
def test_planted_fault_is_named(variant, pattern, converted, tmp_path):
    hf, _ = converted(variant)
    proof.prove_fault_named(hf, tmp_path / "ck", phi3.FAMILY, 1, 3, pattern)


@pytest.mark.parametrize(
    "variant,changes,needles",
    [
        ("longrope", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["'dynamic'"]),
        ("longrope", {"rope_scaling": _longrope(8) | {"factor": 2.0}}, ["'factor'"]),
        (
            "longrope",
            {"rope_scaling": _longrope(8) | {"short_factor": [1.0] * 7}},
            ["rope_scaling.short_factor", "list of 8"],
        ),
        (
            "longrope",
            {"rope_scaling": _longrope(8) | {"long_factor": [1.0] * 7 + [-1.0]}},
            ["rope_scaling.long_factor"],
        ),
        (
            "mini_window",
            {"partial_rotary_factor": 0.2},
            ["partial_rotary_factor=0.2", "3 channels"],
        ),
        ("mini_window", {"partial_rotary_factor": 1.5}, ["partial_rotary_factor=1.5"]),
        ("mini_window", {"sliding_window": 0}, ["sliding_window=0"]),
        ("mini_window", {"embd_pdrop": 0.1}, ["embd_pdrop=0.1"]),
        ("mini_window", {"hidden_act": "gelu"}, ["hidden_act"]),
        ("mini_window", {"model_type": "phi"}, ["model_type"]),
        ("mini_window", {"head_dim": 32}, ["head_dim"]),
        ("mini_window", {"attention_bias": True}, ["attention_bias=true", "no such bias"]),
        (
            "longrope",
            {"original_max_position_embeddings": 0},
            ["original_max_position_embeddings=0"],
        ),
        (
            "longrope",
            {"original_max_position_embeddings": 1},
            ["original_max_position_embeddings=1"],
        ),
    ],
    ids=[
        "dynamic",
        "longrope_extra_key",
        "short_factor_length",
        "long_factor_negative",
        "partial_odd",
        "partial_above_one",
        "zero_window",
        "embedding_dropout_apart",
        "gelu",
        "model_type",
        "head_dim_unmodelled",
        "attention_bias",
        "original_zero",
        "original_one",
    ],
)
def test_config_lint_names_the_field(variant, changes, needles, converted, tmp_path):
    err = proof.refused_import(converted(variant)[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each of the variant's features (window, rope_theta, partial rotary, LongRoPE and its
    original length), perturbed on the HF side alone, moves the gate's logits past 1e-5, or the
    gate's report names it."""
    seen, report = proof.prove_features_named(*converted(variant), features=FEATURES)
    assert report.passed
    want = {"rope_theta"}
    want |= {"sliding_window"} if "window" in variant else set()
    want |= {"partial_rotary_factor"} if variant == "gqa_partial_tied" else set()
    want |= {"rope_scaling", "original_max_position_embeddings"} if "longrope" in variant else set()
    assert want <= set(seen.observed), seen
