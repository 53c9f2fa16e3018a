"""Llama 4 family: the full proof (porting.proof) on tiny random-init ``Llama4ForCausalLM`` models
of the Scout layout (every layer a mixture, L2 q/k norm, llama3 scaling) and the Maverick one
(dense and mixture layers alternating, no q/k norm), and on the vision-language
``Llama4ForConditionalGeneration`` that Scout and Maverick ship as; the routing compared token by
token, a negative control for each piece Megatron-Core lacked, Scout's and Maverick's configs as
published, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). The tiny
models are edited so that every piece bends the logits: the router weights x8 (no top-1
near-tie, no saturated sigmoid), q and k x2, the experts off their zero init, chunks of 8 and a temperature floor of 4 positions on
prompts of over 100 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from converters import llama4
from porting import proof

ARCH, CONTAINER = "Llama4ForCausalLM", "Llama4ForConditionalGeneration"
LAYERS, EXPERTS, CHUNK = 4, 4, 8
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=48,
    intermediate_size_mlp=96,
    head_dim=16,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=EXPERTS,
    num_experts_per_tok=1,
    max_position_embeddings=256,
    rope_theta=10000.0,
    attention_chunk_size=CHUNK,
    floor_scale=4,
    attn_scale=0.5,
)
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
# with the generation cache its fine-tunes' configs name (carried, read by generate() alone)
SCOUT = dict(
    rope_scaling=LLAMA3,
    use_qk_norm=True,
    interleave_moe_layer_step=1,
    cache_implementation="hybrid",
)
# the second layer rotary-free, mixtures on the odd layers
MAVERICK = dict(
    rope_scaling=None, use_qk_norm=False, interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1, 1]
)
VARIANTS = {
    "scout": SCOUT,
    "maverick": MAVERICK,
    "scout_bf16": dict(SCOUT, dtype=torch.bfloat16),
    "scout_vl": SCOUT,  # as Llama4ForConditionalGeneration
}
ROUTER = "feed_forward.router"


def _edit(model) -> None:
    g = torch.Generator().manual_seed(7)
    for name, mod in model.named_modules():
        if name.endswith(ROUTER):
            # logits apart (no top-1 near-tie) yet below sigmoid's fp32 saturation (models.llama4)
            mod.weight.mul_(8.0)
        if name.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            # attention far from uniform on the rotary-free layers too, where no norm rescales
            # q and k: the temperature's scaling of the scores then shows
            mod.weight.mul_(2.0)
        if name.endswith("feed_forward.experts"):
            # Llama4TextExperts starts from zeros
            mod.gate_up_proj.copy_(torch.randn(mod.gate_up_proj.shape, generator=g) * 0.2)
            mod.down_proj.copy_(torch.randn(mod.down_proj.shape, generator=g) * 0.2)


def _make(directory: Path, variant: str) -> Path:
    fields = COMMON | VARIANTS[variant]
    if variant.endswith("_vl"):
        # the container's language model is the text model make_hf builds, edited the same way
        fields = fields | {"edit": _edit}
        return proof.make_container(directory, CONTAINER, ARCH, seed=len(variant), **fields)
    return proof.make_hf(directory, ARCH, seed=len(variant), edit=_edit, **fields)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(tmp_path_factory, _make)


# transformers' own Llama 4 gives a prompt up to 9e-7 apart run alone and in a padded batch (the
# chunks of 8 keys and the L2-normed q/k sharpen every softmax; 4e-7 without either): the
# streamed gate, which runs the batch, is held to twice that
STREAMED_ATOL = 2e-6


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant), streamed_atol=STREAMED_ATOL)


def test_the_gate_holds_one_expert_at_a_time(converted):
    """Both sides stream a mixture layer's experts: Megatron-Core's modules one at a time, and
    transformers' stacks (which Llama4TextExperts multiplies whole with torch.bmm) one expert's
    slice at a time, so a Maverick layer's 128 experts (64 GB in fp32) never sit in memory."""
    ran = proof.prove_experts_streamed(*converted("maverick"))
    assert ran["ExpertStack"] > 0 and len(ran) == 2, ran


@pytest.mark.parametrize("variant", ["scout", "maverick"])
def test_routing_decisions_match_token_by_token(variant, converted):
    # Llama4Router returns the scattered sigmoid scores and the logits
    proof.prove_routing(*converted(variant), ROUTER, router_logits=lambda m, a, out: out[1])


def test_the_config_is_llama_4s(converted):
    """The Megatron knobs each HF piece became."""
    from porting.testing import checkpoint_config

    scout = checkpoint_config(converted("scout")[1])
    assert scout.rotary_interleaved and scout.qk_l2_norm
    assert scout.no_rope_freq == [0, 0, 0, 1]  # Llama4TextConfig's every 4th rotary-free
    assert scout.chunked_attention_layers == [1, 1, 1, 0] and scout.attention_chunk_size == CHUNK
    assert scout.attn_temperature_tuning and scout.attn_floor_scale == 4.0
    assert scout.moe_layer_freq == [1] * LAYERS and scout.moe_router_topk == 1
    assert scout.moe_router_score_function == "sigmoid" and scout.moe_apply_probs_on_input
    assert scout.moe_shared_expert_intermediate_size == scout.moe_ffn_hidden_size == 48
    assert scout.rope_scaling_type == "llama3"
    maverick = checkpoint_config(converted("maverick")[1])
    assert maverick.moe_layer_freq == [0, 1, 0, 1] and maverick.ffn_hidden_size == 96
    assert not maverick.qk_l2_norm and maverick.rope_scaling_type is None


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("scout", "maverick")], tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, converted, tmp_path):
    """Tensors and config.json exactly; the container's vision tower and projector byte for
    byte, and transformers loads it as the multimodal class."""
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    proof.prove_formats(converted("maverick")[0], tmp_path)


def test_permuted_experts_fail_and_the_layer_is_named(converted, tmp_path):
    """Experts 0 and 1 of layer 1 (a mixture) swapped in the table: parity fails there."""
    hf, _ = converted("maverick")
    table = proof.swapped_experts_table(llama4.WEIGHTS, 1, 0, 1, LAYERS, EXPERTS)
    proof.prove_table_fault_named(hf, tmp_path / "ck", llama4.FAMILY, table, 1)


@pytest.mark.parametrize(
    "layer,pattern",
    [(2, "self_attention.linear_proj.weight"), (1, "mlp.shared_experts.linear_fc1.weight")],
    ids=["o_proj", "shared_expert"],
)
def test_planted_fault_is_named(layer, pattern, converted, tmp_path):
    hf, _ = converted("maverick")
    proof.prove_fault_named(hf, tmp_path / "ck", llama4.FAMILY, layer, LAYERS, pattern=pattern)


@pytest.mark.parametrize(
    "variant,changes",
    [
        ("scout", {"chunked_attention_layers": None}),
        ("scout", {"attn_temperature_tuning": False}),
        ("scout", {"qk_l2_norm": False}),
        ("scout", {"moe_apply_probs_on_input": False}),
        ("maverick", {"no_rope_freq": None}),
    ],
    ids=["no_chunks", "no_temperature", "no_qk_norm", "probs_after_expert", "rope_everywhere"],
)
def test_each_piece_is_needed(variant, changes, converted):
    """Negative controls: the converted model run without one piece of Llama 4's attention or
    routing moves the logits at least ten times past the tolerance."""
    from porting.parity import harness

    hf_dir, ckpt = converted(variant)
    prompts = proof.prompts_of(ckpt)
    assert max(p.shape[1] for p in prompts) > 8 * CHUNK  # the chunks and the temperature bite
    mc = proof.megatron_logits_with(ckpt, prompts, **changes)
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 10 * proof.ATOL


def _swapped(key: str, value):
    return lambda config: {key: value}


@pytest.mark.parametrize("variant", ["scout", "maverick"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each of Llama 4's own pieces, perturbed on the HF side alone, moves the gate's logits past
    its tolerance, or the gate's report names it."""
    features = proof.FEATURES | {
        "no_rope_layers": _swapped("no_rope_layers", [1] * LAYERS),
        "attention_chunk_size": _swapped("attention_chunk_size", 4096),
        "attn_temperature_tuning": _swapped("attn_temperature_tuning", False),
        "floor_scale": _swapped("floor_scale", 8),
        "attn_scale": _swapped("attn_scale", 2.0),
        "use_qk_norm": lambda c: {"use_qk_norm": not c.use_qk_norm},
        "interleave_moe_layer_step": lambda c: {"moe_layers": [0, 2]},
    }
    seen, report = proof.prove_features_named(*converted(variant), features=features)
    assert report.passed and report.unobserved == []
    mine = {"no_rope_layers", "attention_chunk_size", "attn_temperature_tuning", "floor_scale"}
    assert mine | {"attn_scale", "use_qk_norm", "interleave_moe_layer_step"} <= set(seen.observed)


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"num_experts_per_tok": 2}, ["num_experts_per_tok=2", "moe_apply_probs_on_input"]),
        ({"layer_types": ["sliding_attention"] * LAYERS}, ["layer_types", "chunked_attention"]),
        ({"attention_chunk_size": None}, ["attention_chunk_size=None"]),
        # transformers builds the chunked mask even where no layer is chunked
        ({"attention_chunk_size": 0, "layer_types": ["full_attention"] * LAYERS},
         ["attention_chunk_size=0"]),
        ({"no_rope_layers": [1, 1, 1, 0, 1], "layer_types": None}, ["lists 5 layers for 4"]),
        ({"layer_types": []}, ["layer_types=[]"]),
        ({"router_aux_loss_coef": None}, ["router_aux_loss_coef=None"]),
        ({"no_rope_layers": [1, 1, 0]}, ["no_rope_layers=[1, 1, 0]", "each of the 4 layers"]),
        ({"moe_layers": [0, 4]}, ["moe_layers=[0, 4]"]),
        # the step counts only where the list is left out (transformers writes the list)
        ({"moe_layers": None, "interleave_moe_layer_step": 0}, ["interleave_moe_layer_step=0"]),
        ({"attention_bias": True}, ["attention_bias"]),
        ({"attn_temperature_tuning": "yes"}, ["attn_temperature_tuning='yes'"]),
        ({"floor_scale": 0}, ["floor_scale=0"]),
        ({"model_type": "llama"}, ["model_type='llama'"]),
        ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
    ],
    ids=["top2", "sliding_layers", "no_chunk_size", "zero_chunk_all_full", "long_rope_list",
         "empty_layer_types", "aux_null", "short_rope_list", "moe_layer_beyond",
         "zero_step", "attention_bias", "temperature_not_a_switch", "zero_floor", "model_type",
         "activation"],
)  # fmt: skip
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("scout")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


def test_the_cards_number_for_a_switch_is_named_where_transformers_5_refuses_it(
    converted, tmp_path
):
    """Scout's card sets ``attn_temperature_tuning: 4``: transformers 5's strict config refuses
    a number there, and the import says which field, before writing anything (this file runs
    on the current stack, transformers 5; 4.57 reads the card: the published cases below)."""
    err = proof.refused_import(converted("scout")[0], {"attn_temperature_tuning": 4}, tmp_path)
    assert "attn_temperature_tuning" in err and "expected bool" in err, err


def test_what_nothing_reads_is_not_checked(converted):
    """With the temperature off, its floor and scale are read by no class: a null one is
    carried, not refused (and the temperature is off in Megatron too)."""
    from porting.contract import config_map

    cfg = json.loads((converted("scout")[0] / "config.json").read_text())
    cfg |= {"attn_temperature_tuning": False, "floor_scale": None, "attn_scale": None}
    mapped = config_map.to_mcore(cfg, llama4.FAMILY.config_entries)
    assert mapped["attn_temperature_tuning"] is False


# meta-llama/Llama-4-Scout-17B-16E's and Llama-4-Maverick-17B-128E's config.json as published
# (transformers 4.51.0), shrunk in size only: the language model to 4 layers of width 64 (8
# heads of 16, 2 KV heads), 4 experts of width 48, a 512-token vocabulary; the vision tower to two
# layers of width 32 on 28-pixel images. Everything else is the card's.
def _published(text: dict, without: tuple[str, ...] = ()) -> dict:
    config = {
        "architectures": [CONTAINER],
        "boi_token_index": 200080,
        "eoi_token_index": 200081,
        "image_token_index": 200092,
        "model_type": "llama4",
        "text_config": {
            "attention_bias": False,
            "attention_chunk_size": 8192,
            "attention_dropout": 0.0,
            "attn_scale": 0.1,
            "attn_temperature_tuning": 4,
            "bos_token_id": 200000,
            "eos_token_id": [200001, 200007, 200008],
            "floor_scale": 8192,
            "for_llm_compressor": False,
            "head_dim": 16,  # 128
            "hidden_act": "silu",
            "hidden_size": 64,  # 5120
            "initializer_range": 0.02,
            "intermediate_size": 48,  # 8192
            "intermediate_size_mlp": 96,  # 16384
            "model_type": "llama4_text",
            "num_attention_heads": 4,  # 40
            "num_experts_per_tok": 1,
            "num_hidden_layers": LAYERS,  # 48
            "num_key_value_heads": 2,  # 8
            "num_local_experts": EXPERTS,  # 16 / 128
            "output_router_logits": False,
            "pad_token_id": 511,  # 200018: the embedding's padding_idx must lie inside it
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 512,  # 202048
            **text,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "vision_config": {
            "attention_dropout": 0.0,
            "hidden_act": "gelu",
            "hidden_size": 32,  # 1408
            "image_size": 28,  # 336
            "initializer_range": 0.02,
            "intermediate_size": 64,  # 5632
            "model_type": "llama4_vision_model",
            "multi_modal_projector_bias": False,
            "norm_eps": 1e-05,
            "num_attention_heads": 2,  # 16
            "num_channels": 3,
            "num_hidden_layers": 2,  # 34
            "patch_size": 14,
            "pixel_shuffle_ratio": 0.5,
            "projector_dropout": 0.0,
            "projector_input_dim": 32,  # 4096
            "projector_output_dim": 32,  # 4096
            "rope_theta": 10000,
            "vision_feature_layer": -1,
            "vision_feature_select_strategy": "default",
            "vision_output_dim": 32,  # 4096
        },
    }
    for key in without:
        del config["text_config"][key]
    return config


PUBLISHED = {
    "Llama-4-Scout-17B-16E": _published(
        {
            "interleave_moe_layer_step": 1,
            "max_position_embeddings": 262144,
            "moe_layers": list(range(LAYERS)),
            "no_rope_layers": [1, 1, 1, 0],  # the card's 48 entries, cut to the layers kept
            "rope_scaling": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "use_qk_norm": True,
        }
    ),
    # Maverick's card leaves the layer lists and the temperature's keys to their defaults
    "Llama-4-Maverick-17B-128E": _published(
        {
            "interleave_moe_layer_step": 2,
            "max_position_embeddings": 1048576,
            "rope_scaling": None,
            "use_qk_norm": False,
        },
        without=("attn_scale", "attn_temperature_tuning", "floor_scale"),
    ),
}


@pytest.mark.nemo2
@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_imports_with_the_gate_and_comes_back(name, tmp_path):
    """As shipped, ``attn_temperature_tuning: 4`` included, under transformers 4.57 (the NeMo 2
    stack), which reads the number as on; transformers 5's strict Llama4TextConfig refuses a
    number there, so no 5.x reference model can be built from the card's file."""
    from porting.api import import_hf

    hf = proof.make_container_as_shipped(tmp_path / "hf", PUBLISHED[name])
    import_hf(hf, tmp_path / "ck", show_progress=False)
    proof.prove_round_trip(hf, tmp_path / "ck", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == PUBLISHED[name]


def test_the_planner_reads_llama_4(tmp_path):
    """Scout plans 48 mixture layers, Maverick 24 between 24 dense ones of their own width, each
    with its shared expert (Family.plan_shape)."""
    from porting.planner.model import from_hf_config

    for name, sparse in (("Llama-4-Scout-17B-16E", LAYERS), ("Llama-4-Maverick-17B-128E", 2)):
        shape = from_hf_config(PUBLISHED[name])
        assert (shape.moe_layers, shape.ffn, shape.moe_ffn, shape.shared_ffn) == (
            sparse,
            96,
            48,
            48,
        ), name
        assert (shape.experts, shape.top_k) == (EXPERTS, 1)
