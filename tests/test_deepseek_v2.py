"""DeepSeek-V2 family (DeepseekV2ForCausalLM: DeepSeek-V2-Lite): the full proof (porting.proof) on
tiny random-init models, the routing compared token by token, the YaRN reading that sets it apart
from DeepSeek-V3's as a negative control, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity).

The tiny models are DeepSeek-V2-Lite's layout at toy sizes (porting.proof's tiny fields): no query
latent, the first layer dense, then 4 routed experts chosen greedily top-2 from a softmax, plus 2
shared experts. The routers are scaled up so that the softmax scores spread, and queries and keys
so that attention is not uniform (:func:`_edit`); every routing decision is checked to be more
than 1e-4 from a tie.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from converters import deepseek, deepseek_v2
from porting import proof

ARCH = "DeepseekV2ForCausalLM"
LAYERS, EXPERTS = 3, 4


def _yarn(**scales) -> dict:
    return {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, **scales}  # fmt: skip


VARIANTS = {
    # DeepSeek-V2-Lite as published: YaRN with equal mscale and mscale_all_dim (a factor of 1)
    "v2_lite": dict(rope_scaling=_yarn(mscale=0.707, mscale_all_dim=0.707)),
    # a query latent, a tied output, scaled routing, YaRN's factor from mscale alone
    "q_lora": dict(
        q_lora_rank=24, tie_word_embeddings=True, routed_scaling_factor=2.0,
        rope_scaling=_yarn(mscale=1.0),
    ),  # fmt: skip
    # mscale and mscale_all_dim apart: transformers' factor is their ratio
    "yarn_ratio": dict(rope_scaling=_yarn(mscale=1.0, mscale_all_dim=0.5), rms_norm_eps=1e-2),
}


def _edit(model) -> None:
    """Routers x20, so that the softmax scores spread; queries and keys x5 each (the key latent's
    scale is normed away, its rotary slice's is not; the values grow too), so that the attention
    of a random init is far from uniform and its softmax scale shows in the logits."""
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):
            mod.weight.mul_(20.0)
        elif name.endswith(("q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")):
            mod.weight.mul_(5.0)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(
            d, ARCH, seed=len(v), edit=_edit, **proof.tiny_fields(ARCH) | VARIANTS[v]
        ),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def _gate_logits(mod, args, out) -> torch.Tensor | None:
    """The router logits of an MoE block, from its input: transformers 4.57's gate module returns
    its choice, and 5.x's block reads the gate's weight without calling the module. None for the
    dense layer's MLP."""
    gate = getattr(mod, "gate", None)
    if gate is None:
        return None
    hidden = args[0].reshape(-1, gate.weight.shape[1])
    return F.linear(hidden.float(), gate.weight.float())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_routing_matches_transformers_token_by_token(variant, converted):
    proof.prove_routing(*converted(variant), "mlp", router_logits=_gate_logits)


@pytest.mark.parametrize("variant", ["v2_lite", "yarn_ratio"])
def test_deepseek_v3s_reading_of_yarn_fails(variant, converted):
    """The negative control of the family's YaRN: DeepSeek-V3's mapping of the same rope_scaling
    (the softmax scale times get_mscale(factor, mscale_all_dim) squared, as the remote code and the
    V3 class compute it) misses the tolerance against transformers' V2 classes."""
    from porting.parity import harness

    hf_dir, ckpt = converted(variant)
    prompts = proof.prompts_of(ckpt)
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    config = {"rope_scaling": VARIANTS[variant]["rope_scaling"], "max_position_embeddings": 256}
    v3 = {k: v for k, v in deepseek._rope_to_mcore(config).items() if k != "rope_type"}
    mc = proof.megatron_logits_with(ckpt, prompts, **v3)
    assert harness.compare(hf, mc).max_abs_diff > 100 * proof.ATOL


@pytest.mark.parametrize(
    "scales,factor",
    [
        (dict(mscale=0.707, mscale_all_dim=0.707), 1.0),
        (dict(mscale=1.0), 0.1 * math.log(40) + 1),
        (dict(mscale_all_dim=0.707), 0.1 * math.log(40) + 1),
        (dict(mscale=1.0, mscale_all_dim=0.5), (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1)),
    ],
    ids=["equal", "mscale", "all_dim_alone", "ratio"],
)
def test_yarn_maps_to_transformers_factor_and_an_unscaled_softmax(scales, factor):
    """Megatron-Core's rotary scale get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim) equals transformers' attention factor, and its softmax scale
    get_mscale(factor, mscale_all_dim) ** 2 / sqrt(d) is 1 / sqrt(d), as transformers' V2 keeps it
    (DeepSeek-V2-Lite's published rope_scaling: factor 40)."""
    rs = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, **scales}
    got = deepseek_v2._rope_to_mcore({"rope_scaling": rs, "max_position_embeddings": 163840})
    assert got["mscale_all_dim"] == 0.0
    rotary = deepseek_v2._get_mscale(40, got["mscale"]) / deepseek_v2._get_mscale(40, 0.0)
    assert rotary == pytest.approx(factor, rel=1e-12)


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in VARIANTS], tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    """Both Megatron layouts; the Bridge layout names the family's own provider
    (models.deepseek_v2_bridge), which Bridge's loader builds: tests/test_owners.py."""
    proof.prove_formats(converted("v2_lite")[0], tmp_path)
    run_config = (tmp_path / "megatron-bridge" / "iter_0000000" / "run_config.yaml").read_text()
    assert "_target_: models.deepseek_v2_bridge.DeepseekV2ModelProvider\n" in run_config


@pytest.mark.parametrize(
    "layer,pattern",
    [(0, "mlp.linear_fc1.weight"), (2, "self_attention.linear_kv_up_proj.weight")],
    ids=["dense", "attention"],
)
def test_planted_fault_is_named(layer, pattern, converted, tmp_path):
    hf, _ = converted("v2_lite")
    proof.prove_fault_named(hf, tmp_path / "ck", deepseek_v2.FAMILY, layer, LAYERS, pattern)


def test_swapped_experts_are_named(converted, tmp_path):
    hf, _ = converted("q_lora")
    table = proof.swapped_experts_table(deepseek_v2.FAMILY.weights, 2, 0, 3, LAYERS, EXPERTS)
    proof.prove_table_fault_named(hf, tmp_path / "ck", deepseek_v2.FAMILY, table, 2)


@pytest.mark.parametrize(
    "changes,needles",
    [
        # DeepSeek-V2 and V2.5 as published
        ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
         ["topk_method='group_limited_greedy'", "DeepSeek-V2, V2.5", "best expert"]),
        ({"topk_method": "noaux_tc"}, ["topk_method='noaux_tc'"]),
        ({"norm_topk_prob": True}, ["norm_topk_prob=true"]),
        ({"scoring_func": "sigmoid"}, ['scoring_func="sigmoid"']),
        ({"mlp_bias": True}, ["mlp_bias=true"]),
        ({"attention_bias": True}, ["attention_bias=true"]),
        ({"num_experts_per_tok": None}, ["num_experts_per_tok=None"]),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling type 'linear'"]),
        ({"model_type": "deepseek_v3"}, ["model_type='deepseek_v3'"]),
    ],  # fmt: skip
    ids=["group_limited", "noaux_tc", "norm_topk", "sigmoid", "mlp_bias", "attention_bias",
         "no_topk", "linear_rope", "model_type"],  # fmt: skip
)
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("v2_lite")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", ["v2_lite", "q_lora"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    seen, report = proof.prove_features_named(*converted(variant))
    assert report.passed and report.unobserved == []
