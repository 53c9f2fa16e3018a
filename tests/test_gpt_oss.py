"""gpt-oss family: the full proof (porting.proof) on tiny random-init ``GptOssForCausalLM`` models
(dequantized layout), the routing compared token by token, the expert-permutation negative
control, a negative control for each piece of the block, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). The tiny
models are edited so that every piece bends the logits: the router weights x30 (no routing
near-tie: the k-th and (k+1)-th logits > 1e-4 apart), the experts' gate/up weights wide enough
that the clamp at 7 cuts (checked below), the sinks and every bias off their zero init, and
4 layers alternating sliding (window 8) and full attention on prompts longer than the window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from converters import gpt_oss
from porting import proof

LAYERS, EXPERTS = 4, 4
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=48,
    head_dim=16,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=EXPERTS,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    rope_theta=10000.0,
)
YARN = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=16,
)
VARIANTS = {
    "yarn": dict(rope_scaling=YARN),
    "no_scaling": dict(rope_scaling=None),
    "yarn_bf16": dict(rope_scaling=YARN, dtype=torch.bfloat16),
    # config.json without the key: GptOssConfig's YaRN default (factor 32 over 4096 positions)
    "rope_absent": {},
    # unscaled as transformers 5 writes it, rope_parameters of rope_type "default": not the
    # class's YaRN default, which a missing rope_scaling would be in transformers 4's spelling
    "no_scaling_v5": dict(rope_scaling=None),
}
ROUTER = "mlp.router"


def _router_logits(mod, args, out):
    # GptOssTopKRouter returns its top-k scores and indices; its logits are the biased linear
    return torch.nn.functional.linear(args[0].reshape(-1, mod.hidden_dim), mod.weight, mod.bias)


def _edit(model) -> None:
    g = torch.Generator().manual_seed(7)
    for name, mod in model.named_modules():
        if name.endswith(ROUTER):
            mod.weight.mul_(30.0)
        if name.endswith("mlp.experts"):
            # pre-activations of order 4: the clamp at 7 cuts some of them
            mod.gate_up_proj.copy_(torch.randn(mod.gate_up_proj.shape, generator=g) * 0.5)
            mod.down_proj.mul_(0.1)
            mod.gate_up_proj_bias.copy_(torch.randn(mod.gate_up_proj_bias.shape, generator=g))
            mod.down_proj_bias.copy_(torch.randn(mod.down_proj_bias.shape, generator=g) * 0.1)
        if name.endswith("self_attn"):
            mod.sinks.copy_(torch.randn(mod.sinks.shape, generator=g))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""

    def make(directory, variant):
        fields = dict(VARIANTS[variant])
        hf = Path(
            proof.make_hf(
                directory, "GptOssForCausalLM", seed=len(variant), edit=_edit, **COMMON, **fields
            )
        )
        cfg = json.loads((hf / "config.json").read_text())
        if variant == "rope_absent":
            del cfg["rope_scaling"]
        if variant == "no_scaling_v5":
            assert cfg.pop("rope_scaling") is None
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        (hf / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return hf

    return proof.imported_variants(tmp_path_factory, make)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


@pytest.mark.parametrize(
    "transformers", [pytest.param(4, marks=pytest.mark.nemo2), 5], ids=lambda v: f"transformers-{v}"
)
def test_the_gate_holds_one_expert_at_a_time(transformers, converted):
    """gpt-oss's stacks (transposed, bias stacks beside them) are read one expert's slice at a
    time, under transformers 4 (its CPU loop) as under 5 (its eager loop)."""
    import transformers as installed

    assert int(installed.__version__.split(".")[0]) == transformers
    ran = proof.prove_experts_streamed(*converted("yarn"))
    assert ran.get("ExpertStack", 0) > 0, ran


@pytest.mark.parametrize("variant", ["yarn", "no_scaling"])
def test_routing_decisions_match_token_by_token(variant, converted):
    proof.prove_routing(*converted(variant), ROUTER, router_logits=_router_logits)


def test_the_config_is_gpt_oss(converted):
    """The Megatron knobs each HF piece became."""
    from porting.testing import checkpoint_config

    config = checkpoint_config(converted("yarn")[1])
    assert config.softmax_type == "learnable"
    assert config.window_size == (7, 0)
    assert config.window_attn_skip_freq == [1, 0, 1, 0]  # GptOssConfig: sliding at even indices
    assert config.activation_func_clamp_value == 7.0 and config.glu_linear_offset == 1.0
    assert config.add_bias_linear and not config.moe_router_pre_softmax
    assert config.num_moe_experts == EXPERTS and config.moe_router_topk == 2
    assert config.rope_scaling_type == "yarn" and config.rope_scaling_truncate is False
    absent = checkpoint_config(converted("rope_absent")[1])
    assert "rope_scaling" not in json.loads(
        (converted("rope_absent")[0] / "config.json").read_text()
    )
    assert (absent.rope_scaling_type, absent.rope_scaling_factor) == ("yarn", 32.0)
    assert absent.rope_scaling_original_max_position_embeddings == 4096
    assert not absent.rope_scaling_truncate
    for unscaled in ("no_scaling", "no_scaling_v5"):
        assert checkpoint_config(converted(unscaled)[1]).rope_scaling_type is None, unscaled


def test_the_clamp_cuts_in_the_test_model(converted):
    """Some expert pre-activations pass the limit, so the clamp is exercised by parity."""
    from transformers import GptOssForCausalLM

    hf = GptOssForCausalLM.from_pretrained(str(converted("yarn")[0]), dtype=torch.float32)
    seen = []
    experts = hf.model.layers[0].mlp.experts
    hook = hf.model.layers[0].post_attention_layernorm.register_forward_hook(
        lambda m, a, out: seen.append(out.reshape(-1, out.shape[-1]))
    )
    hf(torch.arange(2, 40).unsqueeze(0))
    hook.remove()
    gate_up = seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up[..., ::2] > gpt_oss.SWIGLU_LIMIT).any()
    assert (gate_up[..., 1::2].abs() > gpt_oss.SWIGLU_LIMIT).any()


@pytest.mark.parametrize(
    "changes",
    [
        {"activation_func_clamp_value": None},
        {"glu_linear_offset": 0.0},
        {"window_attn_skip_freq": [0, 1, 0, 1]},
        {"window_size": (8, 0)},
        {"moe_router_pre_softmax": True},
    ],
    ids=["no_clamp", "no_offset", "window_layers_swapped", "window_one_wider", "pre_softmax"],
)
def test_each_piece_matters(changes, converted):
    """The checkpoint run with one piece changed must fail parity: each one is really exercised
    (the sinks are the planted fault's, below: the config cannot drop their parameter)."""
    from porting.parity import harness

    hf_dir, ckpt = converted("yarn")
    prompts = proof.prompts_of(ckpt)
    mc = proof.megatron_logits_with(ckpt, prompts, **changes)
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 1e-3


def test_permuted_experts_fail_and_the_layer_is_named(converted, tmp_path):
    """Experts 0 and 1 of layer 1 swapped in the table: parity fails there."""
    hf, _ = converted("yarn")
    table = proof.swapped_experts_table(gpt_oss.WEIGHTS, 1, 0, 1, LAYERS, EXPERTS)
    proof.prove_table_fault_named(hf, tmp_path / "ck", gpt_oss.FAMILY, table, 1)


@pytest.mark.parametrize(
    "pattern",
    ["core_attention.softmax_offset", "mlp.router.bias", "linear_fc1.bias"],
)
def test_planted_fault_is_named(pattern, converted, tmp_path):
    hf, _ = converted("yarn")
    proof.prove_fault_named(hf, tmp_path / "ck", gpt_oss.FAMILY, 2, LAYERS, pattern)


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("yarn", "no_scaling")], tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"swiglu_limit": 10.0}, ["swiglu_limit=10.0", "7.0"]),
        ({"experts_per_token": 3}, ["experts_per_token=3", "num_experts_per_tok=2"]),
        ({"attention_bias": False}, ["attention_bias=false"]),
        ({"hidden_act": "gelu"}, ['hidden_act="gelu"']),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, ["layer_types"]),
        ({"sliding_window": 0}, ["sliding_window=0"]),
        ({"num_experts_per_tok": 5}, ["num_experts_per_tok"]),
        ({"rope_scaling": YARN | {"rope_type": "dynamic"}}, ["dynamic"]),
        ({"model_type": "mixtral"}, ["model_type"]),
    ],
    ids=[
        "swiglu_limit",
        "experts_per_token",
        "attention_bias",
        "hidden_act",
        "layer_type",
        "window0",
        "topk",
        "rope_dynamic",
        "model_type",
    ],
)
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("yarn")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", ["yarn", "no_scaling"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each mapped feature (rope_theta, YaRN, the window and its layers), perturbed on the HF side
    alone, moves the gate's logits past its tolerance, or the gate's report names it."""
    _, report = proof.prove_features_named(*converted(variant)[:2])
    assert report.passed


def test_stacked_expert_transforms_invert_exactly():
    """The interleaved gate/up slice <-> Megatron's [gate; up] fc1, on a GQA-free toy shape."""
    hidden, ffn = 6, 5
    gate_up = torch.randn(hidden, 2 * ffn)
    fc1 = gpt_oss.INTERLEAVED_GATE_UP.forward(gate_up, None)
    assert torch.equal(fc1[:ffn], gate_up[:, ::2].T) and torch.equal(fc1[ffn:], gate_up[:, 1::2].T)
    (back,) = gpt_oss.INTERLEAVED_GATE_UP.inverse(fc1, None)
    assert torch.equal(back, gate_up)
    bias = torch.randn(2 * ffn)
    (bias_back,) = gpt_oss.INTERLEAVED_GATE_UP_BIAS.inverse(
        gpt_oss.INTERLEAVED_GATE_UP_BIAS.forward(bias, None), None
    )
    assert torch.equal(bias_back, bias)
