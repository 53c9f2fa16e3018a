"""OLMoE family: the full proof (porting.proof) on tiny random-init models, the routing decisions
compared token by token, the expert-permutation negative control, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). Ties in
routing are avoided by construction, as in tests/test_moe.py: the router weights are scaled up
(x30) so that the k-th and (k+1)-th router logits of every token are far apart (checked: > 1e-4).
``clip_qkv`` is set where it bends these tiny models' q, k and v (q and k reach ~3 after their
norms; v_proj is scaled up to reach as far), so a dropped clamp fails parity.
"""

from __future__ import annotations

import pytest
import torch

from converters import olmoe
from porting import proof

LAYERS, EXPERTS = 3, 4
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_experts=EXPERTS,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
VARIANTS = {
    "olmoe": dict(num_key_value_heads=4),
    "olmoe_norm_clip": dict(
        num_key_value_heads=2, norm_topk_prob=True, clip_qkv=1.5, tie_word_embeddings=True
    ),
    "olmoe_bf16": dict(num_key_value_heads=4, dtype=torch.bfloat16),
}
ROUTER = "mlp.gate"


def _widen_routers(model) -> None:
    for name, mod in model.named_modules():
        if name.endswith(ROUTER):
            mod.weight.mul_(30.0)
        # v is not normed: at init its values stay far below any clamp, which would then be
        # invisible; scaled up, they reach ~3
        if model.config.clip_qkv is not None and name.endswith("self_attn.v_proj"):
            mod.weight.mul_(20.0)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""

    def make(directory, variant):
        return proof.make_hf(
            directory,
            "OlmoeForCausalLM",
            seed=len(variant),
            edit=_widen_routers,
            **COMMON,
            **VARIANTS[variant],
        )

    return proof.imported_variants(tmp_path_factory, make)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


@pytest.mark.parametrize("variant", ["olmoe", "olmoe_norm_clip"])
def test_routing_decisions_match_token_by_token(variant, converted):
    proof.prove_routing(*converted(variant), ROUTER)


# transformers 5's stacks, read one expert's slice at a time (transformers 4.57's expert modules:
# test_moe.py's Mixtral case)
def test_the_gate_holds_one_expert_at_a_time(converted):
    proof.prove_experts_streamed(*converted("olmoe_norm_clip"))


def test_the_variants_route_and_clamp_as_hf_does(converted):
    from porting.testing import checkpoint_config

    for variant, (pre_softmax, clip) in {
        "olmoe": (True, None),  # norm_topk_prob false: top-k of the full softmax
        "olmoe_norm_clip": (False, 1.5),
    }.items():
        config = checkpoint_config(converted(variant)[1])
        assert config.num_moe_experts == EXPERTS and config.moe_router_topk == 2
        assert config.moe_router_pre_softmax == pre_softmax, variant
        assert config.moe_shared_expert_intermediate_size is None
        assert config.moe_ffn_hidden_size == 48
        assert config.clip_qkv == clip, variant


def test_the_clamp_is_seen(converted, tmp_path):
    """Negative control: the clip_qkv checkpoint without its clamp fails against HF."""
    import json
    import shutil

    hf, _ = converted("olmoe_norm_clip")
    unclipped = tmp_path / "hf"
    shutil.copytree(hf, unclipped)
    cfg = json.loads((unclipped / "config.json").read_text())
    cfg["clip_qkv"] = None
    (unclipped / "config.json").write_text(json.dumps(cfg))
    from porting.api import import_hf
    from porting.parity import harness

    import_hf(unclipped, tmp_path / "ck", verify=False, show_progress=False)
    hf_logits, mc = proof.logits(hf, tmp_path / "ck")
    assert harness.compare(hf_logits, mc).max_abs_diff > 100 * proof.ATOL


def test_permuted_experts_fail_and_the_layer_is_named(converted, tmp_path):
    """Experts 0 and 1 of layer 1 swapped in the table: parity fails there."""
    hf, _ = converted("olmoe")
    table = proof.swapped_experts_table(olmoe.WEIGHTS, 1, 0, 1, LAYERS, EXPERTS)
    proof.prove_table_fault_named(hf, tmp_path / "ck", olmoe.FAMILY, table, 1)


@pytest.mark.parametrize(
    "pattern", ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
)
def test_planted_fault_is_named(pattern, converted, tmp_path):
    hf, _ = converted("olmoe_norm_clip")
    proof.prove_fault_named(hf, tmp_path / "ck", olmoe.FAMILY, 2, LAYERS, pattern)


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("olmoe", "olmoe_norm_clip")], tmp_path)


@pytest.mark.parametrize("variant", ["olmoe_norm_clip", "olmoe_bf16"])
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"clip_qkv": 0}, ["clip_qkv=0"]),
        ({"clip_qkv": -1.0}, ["clip_qkv=-1.0"]),
        ({"attention_bias": True}, ["attention_bias=True"]),
        ({"num_experts_per_tok": 5}, ["num_experts_per_tok=5", "num_experts=4"]),
        ({"model_type": "qwen2_moe"}, ["model_type='qwen2_moe'"]),
        ({"head_dim": 32}, ["head_dim"]),
        ({"shared_expert_intermediate_size": 80}, ["shared_expert_intermediate_size"]),
    ],
    ids=["clip0", "clip_negative", "o_bias", "topk", "model_type", "head_dim", "shared"],
)
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("olmoe")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", ["olmoe", "olmoe_norm_clip"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each mapped feature (rope_theta), perturbed on the HF side alone, moves the gate's logits
    past its tolerance, or the gate's report names it."""
    _, report = proof.prove_features_named(*converted(variant)[:2])
    assert report.passed
