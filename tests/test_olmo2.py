"""OLMo 2 family: the full proof (porting.proof) on tiny random-init models, each OLMo-specific
piece pinned by a planted fault, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). The
norm weights are moved off their init (make_hf), so a q/k norm read per head, or a post-norm
dropped or misplaced, fails parity.
"""

from __future__ import annotations

import pytest
import torch

from converters import olmo2
from porting import proof

LAYERS = 3
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    max_position_embeddings=256,
    rope_theta=500000.0,
    rms_norm_eps=1e-6,
)
VARIANTS = {
    "mha_untied": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "tied_head_dim": dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "gqa_bf16": dict(num_key_value_heads=2, dtype=torch.bfloat16),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(d, "Olmo2ForCausalLM", seed=len(v), **COMMON, **VARIANTS[v]),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    """Each rank norms its heads by the RMS of all of them: two ranks give one rank's logits."""
    proof.prove_tp2([converted(v)[1] for v in ("gqa", "tied_head_dim")], tmp_path)


def test_tensor_parallel_2_needs_the_norms_all_reduce(converted, tmp_path):
    """Negative control: at TP=2 with each rank's RMS taken over its own heads, the logits move
    far past the tolerance, so the TP test above sees the reduction."""
    from porting.parity import harness

    ckpt = converted("gqa")[1]
    ids = torch.randint(0, 130, (2, 24), generator=torch.Generator().manual_seed(3))
    local_norm = [
        ("models.olmo_attention:HeadShardedRMSNorm.mean_square",
         "models.olmo_attention:RMSNorm.mean_square"),
    ]  # fmt: skip
    local = proof.tp2_logits([ckpt], ids, tmp_path, patches=local_norm)[str(ckpt)]
    (tp1,) = harness.megatron_logits_from_checkpoint(ckpt, [ids], local.shape[-1])
    assert (local - tp1).abs().max() > 100 * proof.ATOL


@pytest.mark.parametrize("variant", ["mha_untied", "tied_head_dim", "gqa_bf16"])
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


@pytest.mark.parametrize(
    "pattern",
    [
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "linear_proj.post_layernorm.weight",
        "linear_fc2.post_layernorm.weight",
    ],
)
def test_planted_fault_is_named(pattern, converted, tmp_path):
    hf, _ = converted("gqa")
    proof.prove_fault_named(hf, tmp_path / "ck", olmo2.FAMILY, 1, LAYERS, pattern)


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"attention_bias": True}, ["attention_bias=True", "o_proj"]),
        ({"head_dim": None}, ["head_dim=None"]),
        ({"model_type": "llama"}, ["model_type='llama'"]),
        ({"hidden_act": "gelu"}, ["hidden_act"]),
        ({"clip_qkv": 8.0}, ["clip_qkv"]),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["dynamic"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads=3"]),
    ],
    ids=["o_bias", "head_dim_null", "model_type", "activation", "clip_qkv", "dynamic", "kv_heads"],
)
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("gqa")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", ["gqa", "tied_head_dim"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each mapped feature (rope_theta), perturbed on the HF side alone, moves the gate's logits
    past its tolerance, or the gate's report names it."""
    _, report = proof.prove_features_named(*converted(variant)[:2])
    assert report.passed


def test_a_rope_scaled_olmo2_is_refused_in_the_bridge_layout(tmp_path):
    """A model Bridge's GPTModelProvider cannot describe, of a family that ships no provider of
    its own (OLMo 2, rotary scaling): refused by name before any tensor is read, nothing
    written (porting.proof.prove_bridge_refused)."""
    hf = proof.make_hf(
        tmp_path / "hf", "Olmo2ForCausalLM", **COMMON, num_key_value_heads=2,
        rope_scaling={"type": "linear", "factor": 2.0},  # the spelling 4.57's Olmo2Config reads
    )  # fmt: skip
    proof.prove_bridge_refused(hf, tmp_path, ["rope_scaling_type"])
