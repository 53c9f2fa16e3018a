"""Gemma 3 family (text ``Gemma3ForCausalLM``): the full proof (porting.proof) on tiny random-init
models, the two rotary tables pinned by negative controls, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). The
window is 8 and the gate's prompts pass it; local and global bases differ by 10^4 (100 and 1e6),
so a layer rotated with the other kind's table moves the logits far past the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from converters import gemma3
from porting import proof

COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    head_dim=32,
    sliding_window=8,
    query_pre_attn_scalar=24,
    rope_theta=1e6,
    rope_local_base_freq=100.0,
)
VARIANTS = {
    # gemma-3-1b's layout: MQA, the pattern form of the layer kinds (here every 2nd global)
    "gemma3": dict(num_key_value_heads=1, sliding_window_pattern=2),
    # the larger checkpoints' text config: GQA, linear scaling on the global layers
    "gemma3_gqa_linear": dict(
        num_key_value_heads=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "gemma3_untied_cap": dict(
        num_key_value_heads=2,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        tie_word_embeddings=False,
        final_logit_softcapping=0.2,
    ),
    "gemma3_bf16": dict(num_key_value_heads=2, sliding_window_pattern=2, dtype=torch.bfloat16),
}
_LOCAL_BASE = {"rope_local_base_freq": proof.features._doubled("rope_local_base_freq")}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(d, "Gemma3ForCausalLM", seed=len(v), **COMMON, **VARIANTS[v]),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


@pytest.mark.parametrize(
    "variant,changes",
    [
        ("gemma3", {"rotary_base_local": 1e6}),
        ("gemma3", {"rotary_base": 100.0}),
        ("gemma3_gqa_linear", {"seq_len_interpolation_factor": None}),
        ("gemma3", {"window_attn_skip_freq": [1, 1, 1]}),
        ("gemma3", {"window_size": (8, 0)}),
        ("gemma3", {"softmax_scale": None}),
        ("gemma3_untied_cap", {"final_logit_softcapping": None}),
    ],
    ids=[
        "local_layers_global_base",
        "global_layers_local_base",
        "no_linear_scaling",
        "every_layer_local",
        "window_one_wider",
        "head_dim_scale",
        "no_final_softcap",
    ],
)
def test_each_gemma3_piece_matters(variant, changes, converted):
    """The checkpoint run with one piece changed must fail parity: each one is really exercised
    (each rotary base alone, so neither table is the other's)."""
    from porting.parity import harness

    hf_dir, ckpt = converted(variant)
    prompts = proof.prompts_of(ckpt)
    mc = proof.megatron_logits_with(ckpt, prompts, **changes)
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 1e-3


def test_the_model_builds_what_it_claims(converted):
    """q/k norms per head, sandwich norms and each layer's table (local on sliding layers)."""
    from models.gemma3 import Gemma3SelfAttention, LocalGlobalRotaryEmbedding
    from models.gemma_spec import GemmaRMSNorm, PostNormRowParallelLinear
    from porting.convert.megatron import init_parallel
    from porting.testing import load_checkpoint_model

    init_parallel()
    model, config = load_checkpoint_model(converted("gemma3")[1])
    assert config.window_attn_skip_freq == [1, 0, 1] and config.window_size == (7, 0)
    assert isinstance(model.rotary_pos_emb, LocalGlobalRotaryEmbedding)
    assert model.rotary_pos_emb.local_rope.inv_freq[1].item() == pytest.approx(100 ** (-2 / 32))
    for layer in model.decoder.layers:
        attn = layer.self_attention
        assert isinstance(attn, Gemma3SelfAttention)
        assert isinstance(attn.q_layernorm, GemmaRMSNorm) and attn.q_layernorm.weight.numel() == 32
        assert isinstance(attn.k_layernorm, GemmaRMSNorm)
        assert isinstance(attn.linear_proj, PostNormRowParallelLinear)


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    # MQA (one KV head) cannot be split over two ranks in Megatron; GQA can
    proof.prove_tp2([converted(v)[1] for v in ("gemma3_gqa_linear", "gemma3_untied_cap")], tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


@pytest.mark.parametrize(
    "pattern",
    [
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "mlp.linear_fc1.weight",
    ],
)
def test_planted_fault_is_named(pattern, converted, tmp_path):
    hf, _ = converted("gemma3_gqa_linear")
    proof.prove_fault_named(hf, tmp_path / "ck", gemma3.FAMILY, 1, 3, pattern)


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"attention_bias": True}, ["attention_bias=True", "o_proj"]),
        ({"hidden_activation": "relu"}, ["hidden_activation='relu'"]),
        ({"layer_types": ["sliding_attention"]}, ["layer_types", "3 layers"]),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            ["layer_types"],
        ),
        ({"sliding_window": None}, ["sliding_window is null"]),
        ({"sliding_window_pattern": 0}, ["sliding_window_pattern=0"]),
        ({"rope_local_base_freq": -1.0}, ["rope_local_base_freq=-1.0"]),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, ["rope_scaling", "'yarn'"]),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "x": 1}}, ["'x'"]),
        ({"use_bidirectional_attention": True}, ["use_bidirectional_attention=true"]),
        ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping=50.0", "never passes"]),
        ({"model_type": "gemma2"}, ["model_type='gemma2'"]),
        ({"hidden_act": "gelu"}, ["hidden_act"]),
        ({"num_key_value_heads": None}, ["num_key_value_heads=None"]),
    ],
    ids=[
        "o_bias",
        "relu",
        "layer_types_short",
        "layer_kind_unknown",
        "null_window",
        "zero_pattern",
        "negative_local_base",
        "yarn",
        "rope_key",
        "bidirectional",
        "attn_cap_unread",
        "model_type",
        "hidden_act_unread",
        "null_kv_heads",
    ],
)
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("gemma3")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each of the variant's features (window, layer kinds, both rotary bases, scaling, caps,
    softmax scale), perturbed on the HF side alone, moves the gate's logits past 1e-5, or the
    gate's report names it."""
    seen, report = proof.prove_features_named(
        *converted(variant), features=proof.FEATURES | _LOCAL_BASE
    )
    assert report.passed
    want = {"sliding_window", "layer_types", "rope_theta", "rope_local_base_freq"}
    if variant == "gemma3_gqa_linear":
        want.add("rope_scaling")
    if variant == "gemma3_untied_cap":
        want.add("final_logit_softcapping")
    assert want <= set(seen.observed), seen
