"""DeepSeek family (DeepseekV3ForCausalLM: DeepSeek-V3, Kimi K2, Moonlight): the full proof
(porting.proof) on tiny random-init models, the routing decisions compared token by token, the
expert-permutation negative control, and the configs and checkpoints it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity).

The tiny models are DeepSeek-V3's shape at toy sizes: multi-latent attention with q and kv LoRA
ranks (or one q_proj), the first layer dense and the others 4 routed experts, top-2, in 2 groups
of which 1 is chosen, plus 1 shared expert. The routers are scaled up (x10) so that sigmoid
scores spread over (0, 1), and every ``e_score_correction_bias`` is set to a random value in
[0, 0.5): the expert bias then decides some tokens' groups (its negative control is the features
check), and every choice score stays above transformers 4.57's 0-fill of unchosen groups
(5.x fills -inf; see models/deepseek.py). Ties are avoided and checked: every group and expert decision of every token
is more than 1e-4 from a tie.

The ``mtp`` variant is DeepSeek-V3 as published: one multi-token-prediction layer after the
decoder's (tests/deepseek_mtp.py writes it, since transformers writes none), imported into
Megatron-Core's MTP block; its logits are compared with transformers' own decoder layer and norms
wired as the DeepSeek-V3 report defines the module, and by the gate.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from converters import deepseek
from porting import proof
from porting.cli import main
from porting.contract.mapping import Fused, Rename

_spec = importlib.util.spec_from_file_location(
    "deepseek_mtp", Path(__file__).with_name("deepseek_mtp.py")
)
deepseek_mtp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deepseek_mtp)

ARCH = "DeepseekV3ForCausalLM"
LAYERS, EXPERTS = 3, 4
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
VARIANTS = {
    "v3": {},
    # an eps far from the latent norms' fixed 1e-6 (Moonlight's is 1e-5), so that using it there
    # would show
    "q_full": dict(q_lora_rank=None, rms_norm_eps=1e-2),
    "yarn": dict(rope_scaling=YARN),
    "v3_bf16": dict(dtype=torch.bfloat16),
    # DeepSeek-V3 as published: one multi-token-prediction layer after the decoder's (added by
    # tests/deepseek_mtp.py, since transformers writes none)
    "mtp": {},
}


def _edit(model) -> None:
    gen = torch.Generator().manual_seed(7)
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):
            mod.weight.mul_(10.0)
            mod.e_score_correction_bias.copy_(0.5 * torch.rand(EXPERTS, generator=gen))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""

    def make(directory, variant):
        fields = proof.tiny_fields(ARCH) | VARIANTS[variant]
        hf = proof.make_hf(directory, ARCH, seed=len(variant), edit=_edit, **fields)
        if variant == "mtp":
            deepseek_mtp.add_mtp_layer(hf, seed=5)
        return hf

    return proof.imported_variants(tmp_path_factory, make)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def test_latent_norms_at_the_config_eps_fail(converted, monkeypatch):
    """The negative control of the latent norms' fixed epsilon: built at the config's
    rms_norm_eps (as Megatron-Core's spec would), the q_full model misses the tolerance."""
    from porting.parity import harness

    monkeypatch.setattr("models.deepseek.LATENT_NORM_EPS", 1e-2)
    hf, mc = proof.logits(*converted("q_full"))
    assert harness.compare(hf, mc).max_abs_diff > 100 * proof.ATOL


def _choice(margins: list[float], decided_here: list[torch.Tensor]):
    """``router_logits`` for proof.prove_routing: the scores transformers' DeepSeek-V3 router takes
    its top-k of, recomputed from the router's input (sigmoid, expert bias, the best
    ``topk_group`` groups by their top two scores, 0 for the other groups' experts: every chosen
    score is above it); ``decided_here`` collects the experts they choose, to be checked against
    transformers' own choice (:func:`_transformers_choices`), ``margins`` each call's smallest
    group-choice gap."""

    def choice(mod, args, out):
        cfg = mod.config
        n_group, topk_group = cfg.n_group, cfg.topk_group
        hidden = args[0].reshape(-1, mod.weight.shape[1])
        scores = F.linear(hidden.float(), mod.weight.float()).sigmoid()
        biased = scores + mod.e_score_correction_bias
        groups = biased.view(-1, n_group, EXPERTS // n_group).topk(2, -1)[0].sum(-1)
        ranked = groups.sort(-1, descending=True).values
        margins.append((ranked[:, topk_group - 1] - ranked[:, topk_group]).min().item())
        chosen = torch.zeros_like(groups).scatter(1, groups.topk(topk_group, -1).indices, 1)
        keep = chosen.repeat_interleave(EXPERTS // n_group, -1).bool()
        decided = biased.masked_fill(~keep, 0.0)
        decided_here.append(decided.topk(cfg.num_experts_per_tok, -1).indices.sort(-1).values)
        return decided

    return choice


def _transformers_choices(monkeypatch) -> list[torch.Tensor]:
    """The experts transformers itself chooses per token, sorted, one tensor per router call:
    transformers 4.57 decides in the router (``get_topk_indices``), 5.x in the MoE block
    (``route_tokens_to_experts``, after the router returns its logits)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    chosen: list[torch.Tensor] = []
    if hasattr(m.DeepseekV3TopkRouter, "get_topk_indices"):
        cls, name = m.DeepseekV3TopkRouter, "get_topk_indices"
    else:
        cls, name = m.DeepseekV3MoE, "route_tokens_to_experts"
    original = getattr(cls, name)

    def recorded(self, *args):
        out = original(self, *args)
        chosen.append((out[0] if isinstance(out, tuple) else out).sort(-1).values)
        return out

    monkeypatch.setattr(cls, name, recorded)
    return chosen


@pytest.mark.parametrize("variant", ["v3", "yarn"])
def test_routing_decisions_match_token_by_token(variant, converted, monkeypatch):
    margins: list[float] = []
    ours: list[torch.Tensor] = []
    theirs = _transformers_choices(monkeypatch)
    proof.prove_routing(*converted(variant), "mlp.gate", router_logits=_choice(margins, ours))
    assert margins and min(margins) > 1e-4, f"a group-choice near-tie ({min(margins):.2e})"
    # the scores handed to the comparison choose what transformers chose, call by call
    assert len(ours) == len(theirs) > 0
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_the_gate_holds_one_expert_at_a_time(converted, monkeypatch):
    """A dense first layer, then MoE layers with a shared expert, then the multi-token layer: only
    the routed experts stream, on the HF side as transformers 5's stacks, one expert's slice at a
    time, the multi-token layer's too (its reads counted apart)."""
    from porting.parity import mtp

    in_mtp = []
    real = mtp.stream_expert_stacks

    def counted(layer, read):
        in_mtp.append(real(layer, read))
        return in_mtp[-1]

    monkeypatch.setattr(mtp, "stream_expert_stacks", counted)
    kinds = proof.prove_experts_streamed(*converted("mtp"))
    assert set(kinds) == {"ExpertStack", "TransformerLayer", "MultiTokenPredictionBlock"}, kinds
    # the multi-token layer's two stacks were streamed too
    assert in_mtp == [2], in_mtp
    kinds = proof.prove_experts_streamed(*converted("mtp"))
    assert "MultiTokenPredictionBlock" in kinds, kinds  # the MTP check streams its experts too


def test_the_variants_map_as_deepseek_routes(converted):
    """Sigmoid routing with the expert bias, groups, scaling, dense first layer, shared expert,
    MLA widths, and the rotary each variant implies."""
    from porting.testing import checkpoint_config

    for variant in ("v3", "q_full", "yarn"):
        c = checkpoint_config(converted(variant)[1])
        assert c.multi_latent_attention and c.moe_router_score_function == "sigmoid"
        assert c.moe_router_enable_expert_bias and c.moe_router_topk_scaling_factor == 2.5
        assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk) == (2, 1, 2)
        assert c.moe_layer_freq == [0, 1, 1] and c.num_moe_experts == EXPERTS
        assert (c.ffn_hidden_size, c.moe_ffn_hidden_size) == (96, 48)
        assert c.moe_shared_expert_intermediate_size == 48
        assert (c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (
            16, 16, 8, 16,
        )  # fmt: skip
        assert c.q_lora_rank == (None if variant == "q_full" else 32)
        assert c.rope_type == ("yarn" if variant == "yarn" else "rope")
    yarn = checkpoint_config(converted("yarn")[1])
    assert (yarn.rotary_scaling_factor, yarn.mscale, yarn.mscale_all_dim) == (4.0, 1.0, 0.8)
    assert yarn.original_max_position_embeddings == 16


def test_permuted_experts_fail_and_the_layer_is_named(converted, tmp_path):
    """Experts 0 and 1 of layer 1 swapped in the table: parity fails there."""
    hf, _ = converted("v3")
    swapped = proof.swapped_experts_table(deepseek.WEIGHTS, 1, 0, 1, LAYERS, EXPERTS)

    def dense_layer_expert(e) -> bool:  # the swap writes every layer's; layer 0 has none
        names = (e.hf,) if isinstance(e, Rename) else e.hf if isinstance(e, Fused) else ()
        return any(n.startswith("model.layers.0.mlp.experts.") for n in names)

    table = tuple(e for e in swapped if not dense_layer_expert(e))
    proof.prove_table_fault_named(hf, tmp_path / "ck", deepseek.FAMILY, table, 1)


@pytest.mark.parametrize(
    "variant,layer,pattern",
    [
        ("v3", 2, "self_attention.linear_q_up_proj.weight"),
        ("v3", 1, "self_attention.kv_layernorm.weight"),
        ("q_full", 0, "self_attention.linear_proj.weight"),
    ],
)
def test_planted_fault_is_named(variant, layer, pattern, converted, tmp_path):
    hf, _ = converted(variant)
    proof.prove_fault_named(hf, tmp_path / "ck", deepseek.FAMILY, layer, LAYERS, pattern)


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("v3", "q_full", "yarn", "mtp")], tmp_path)


@pytest.mark.parametrize("variant", ["v3_bf16", "q_full", "yarn", "mtp"])
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    """Both Megatron layouts; the Bridge layout names the family's own provider
    (models.deepseek_bridge: Bridge's GPTModelProvider has no MLA), which Bridge's loader builds:
    tests/test_owners.py."""
    proof.prove_formats(converted("v3")[0], tmp_path)
    run_config = (tmp_path / "megatron-bridge" / "iter_0000000" / "run_config.yaml").read_text()
    assert "_target_: models.deepseek_bridge.DeepseekModelProvider\n" in run_config


def _damaged(converted, tmp_path, change, variant="v3"):
    hf = tmp_path / "hf"
    shutil.copytree(converted(variant)[0], hf)
    tensors = load_file(hf / "model.safetensors")
    change(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return hf


def _f32_expert_bias(tensors) -> None:
    # as the DeepSeek-V3 and Kimi K2 releases store it beside BF16 weights; values bf16 cannot
    # hold, so that a cast anywhere on the way shows in the round trip
    gen = torch.Generator().manual_seed(11)
    for key in sorted(tensors):
        if key.endswith("mlp.gate.e_score_correction_bias"):
            tensors[key] = 0.5 * torch.rand(EXPERTS, generator=gen, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_f32_expert_bias_beside_bf16_weights_is_kept_and_exported_f32(dtype, converted, tmp_path):
    """A bf16 checkpoint holding every e_score_correction_bias as F32 (the family's fp32_tensors):
    the import needs no --dtype (the bias does not vote) and, with --dtype bfloat16 too, keeps it
    fp32 into Megatron; it passes the gate, and export gives every tensor back bit for bit, the
    bias as F32 and the rest as BF16."""
    from safetensors import safe_open

    from porting.api import import_hf
    from porting.convert.checkpoint import open_checkpoint

    hf = _damaged(converted, tmp_path, _f32_expert_bias, "v3_bf16")
    with safe_open(hf / "model.safetensors", "pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    biases = sorted(k for k in stored if k.endswith("e_score_correction_bias"))
    assert biases and {stored[k] for k in biases} == {"F32"}
    assert {v for k, v in stored.items() if k not in biases} == {"BF16"}
    ckpt = tmp_path / "nemo"
    import_hf(hf, ckpt, dtype=dtype, show_progress=False)
    manifest = open_checkpoint(ckpt).manifest
    assert (manifest.dtype, manifest.fp32_tensors) == ("bfloat16", biases)
    proof.prove_parity(hf, ckpt)
    proof.prove_round_trip(hf, ckpt, tmp_path / "hf-back")
    with safe_open(tmp_path / "hf-back" / "model.safetensors", "pt") as f:
        assert {k: f.get_slice(k).get_dtype() for k in f.keys()} == stored


@pytest.mark.parametrize(
    "change,needles",
    [
        (
            lambda t: t.pop("model.layers.1.mlp.experts.3.down_proj.weight"),
            ["missing from the checkpoint", "layers.1.mlp.experts.3.down_proj.weight"],
        ),
        (
            lambda t: t.pop("model.layers.2.mlp.gate.e_score_correction_bias"),
            ["missing from the checkpoint", "layers.2.mlp.gate.e_score_correction_bias"],
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(48, 64)}
            ),
            ["model.layers.0.mlp.experts.0.up_proj.weight"],
        ),
    ],
    ids=["missing_expert", "missing_expert_bias", "expert_in_dense_layer"],
)
def test_damaged_checkpoint_is_located_and_nothing_written(
    change, needles, converted, tmp_path, capsys
):
    hf = _damaged(converted, tmp_path, change)
    out = tmp_path / "out"
    code = main(["import", str(hf), "--out", str(out), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2, err
    for needle in needles:
        assert needle in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"norm_topk_prob": False}, ["norm_topk_prob=False"]),
        ({"rope_interleave": False}, ["rope_interleave=false"]),
        ({"attention_bias": True}, ["attention_bias=true"]),
        ({"num_key_value_heads": 2}, ["num_key_value_heads=2"]),
        ({"n_group": 4, "topk_group": 2}, ["n_group=4", "top 2 experts", "top 1"]),
        ({"n_group": 3}, ["n_group=3", "n_routed_experts=4"]),
        ({"num_experts_per_tok": 1}, ["num_experts_per_tok=1"]),
        ({"first_k_dense_replace": 4}, ["first_k_dense_replace=4"]),
        ({"qk_head_dim": 20}, ["qk_head_dim=20"]),
        ({"scoring_func": "softmax"}, ['scoring_func="softmax"']),
        ({"topk_method": "greedy"}, ['topk_method="greedy"']),
        ({"moe_layer_freq": 2}, ["moe_layer_freq=2"]),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ["'linear'"]),
        ({"rope_scaling": YARN | {"attention_factor": 1.2}}, ["attention_factor=1.2"]),
        ({"rope_scaling": YARN | {"mscale": 0}}, ["mscale_all_dim=0.8 without mscale"]),
        ({"model_type": "deepseek_v2"}, ["model_type"]),
        ({"num_nextn_predict_layers": 2}, ["num_nextn_predict_layers=2", "one"]),
        ({"num_nextn_predict_layers": -1}, ["num_nextn_predict_layers must be"]),
        (
            {"num_nextn_predict_layers": 1, "first_k_dense_replace": 3},
            ["first_k_dense_replace=3", "mixture of experts"],
        ),
        (
            {"num_nextn_predict_layers": 1, "tie_word_embeddings": True},
            ["tie_word_embeddings=true"],
        ),
    ],
    ids=[
        "norm_topk",
        "interleave",
        "attention_bias",
        "kv_heads",
        "group_score",
        "groups",
        "topk1",
        "dense_layers",
        "qk_head_dim",
        "scoring",
        "topk_method",
        "moe_layer_freq",
        "rope_linear",
        "attention_factor",
        "mscale",
        "model_type",
        "mtp_two",
        "mtp_negative",
        "mtp_dense",
        "mtp_tied",
    ],
)
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("v3")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


def _set(name: str, value):
    def perturb(config) -> dict | None:
        return {name: value} if getattr(config, name, None) != value else None

    return perturb


FEATURES = proof.FEATURES | {
    "routed_scaling_factor": _set("routed_scaling_factor", 1.0),
    "norm_topk_prob": _set("norm_topk_prob", False),
    "topk_group": _set("topk_group", 2),
}


@pytest.mark.parametrize("variant", ["v3", "yarn"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each mapped feature (rope_theta, YaRN, the routing switches), perturbed on the HF side
    alone, moves the gate's logits past its tolerance, or the gate's report names it."""
    seen, report = proof.prove_features_named(*converted(variant)[:2], features=FEATURES)
    assert report.passed
    assert {"routed_scaling_factor", "norm_topk_prob", "topk_group"} <= set(seen.observed)
    if variant == "yarn":
        assert "rope_scaling" in seen.observed


def _mtp_logits(ckpt, prompts) -> list[torch.Tensor]:
    from porting.convert.megatron import init_parallel, load_mcore_from_checkpoint, mtp_logits

    init_parallel()
    model, _ = load_mcore_from_checkpoint(ckpt, deepseek.FAMILY, torch.float32)
    return [mtp_logits(model, p)[0][..., :VOCAB] for p in prompts]


def _hf_mtp_logits(hf, prompts) -> list[torch.Tensor]:
    return [deepseek_mtp.hf_mtp_logits(hf, p) for p in prompts]


VOCAB = proof.tiny_fields(ARCH)["vocab_size"]


def test_multi_token_prediction_layer_matches_transformers_modules(converted):
    """The published layout's prediction layer (model.layers.3.*) imported into Megatron-Core's
    MTP block: its logits at every position equal those of transformers' own DeepseekV3 decoder
    layer and RMSNorm wired as the DeepSeek-V3 report defines the module (tests/deepseek_mtp.py),
    atol=rtol=1e-5 on every logit."""
    from porting.testing import checkpoint_config

    hf, ckpt = converted("mtp")
    c = checkpoint_config(ckpt)
    assert (c.mtp_num_layers, c.mtp_loss_scaling_factor) == (1, 0.1)
    prompts = proof.prompts_of(ckpt)
    proof.assert_parity(_hf_mtp_logits(hf, prompts), _mtp_logits(ckpt, prompts))


def test_the_gate_compares_the_multi_token_prediction_logits(converted):
    """The gate runs the MTP layer on both sides (porting.parity.mtp) and reports it."""
    from porting.parity.harness import verify

    report = verify(*converted("mtp"))
    assert report.passed and [m["layer"] for m in report.mtp] == [0], report.summary()
    assert report.mtp[0]["max_abs_diff"] < proof.ATOL and "MTP layer 0" in report.summary()


@pytest.mark.parametrize(
    "swap", [("enorm", "hnorm"), ("shared_head.norm", "hnorm")], ids=["e_h", "head_h"]
)
def test_multi_token_prediction_fault_fails_the_gate(swap, converted, tmp_path):
    """Negative control: two of the layer's norms swapped in the checkpoint import cleanly (same
    shapes); against the original, the main logits still pass and the MTP layer's fail the gate,
    and miss transformers' modules (the test's own reference) by far."""
    from porting.api import import_hf
    from porting.parity import harness

    hf, ckpt = converted("mtp")
    bad = tmp_path / "hf"
    shutil.copytree(hf, bad)
    path = bad / deepseek_mtp.MTP_FILE
    tensors = load_file(path)
    a, b = (f"model.layers.{LAYERS}.{n}.weight" for n in swap)
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, path, metadata={"format": "pt"})
    import_hf(bad, tmp_path / "nemo", verify=False, show_progress=False)
    report = harness.verify(hf, tmp_path / "nemo")
    assert not report.passed and not report.mtp[0]["passed"], report.summary()
    assert report.max_abs_diff < proof.ATOL  # the main head is untouched
    assert "MTP layer 0" in report.summary() and "FAIL" in report.summary()
    prompts = proof.prompts_of(ckpt)
    diff = harness.compare(
        _hf_mtp_logits(hf, prompts), _mtp_logits(tmp_path / "nemo", prompts)
    ).max_abs_diff
    assert diff > 100 * proof.ATOL


@pytest.mark.parametrize("copy", ["embed_tokens", "shared_head.head"])
def test_a_copy_that_differs_from_the_model_is_refused(copy, converted, tmp_path, capsys):
    """The layer's embedding and head are the model's, shared in Megatron-Core's block: a copy one
    value off is refused by name, and nothing is written."""
    hf = tmp_path / "hf"
    shutil.copytree(converted("mtp")[0], hf)
    path = hf / deepseek_mtp.MTP_FILE
    tensors = load_file(path)
    key = f"model.layers.{LAYERS}.{copy}.weight"
    tensors[key][3, 5] += 1e-3
    save_file(tensors, path, metadata={"format": "pt"})
    out = tmp_path / "out"
    code = main(["import", str(hf), "--out", str(out), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert key in err and f"layer's {copy} differs from the model's" in err, err
    assert not out.exists()


def test_a_declared_layer_that_is_absent_imports_the_decoder_and_comes_back_as_it_came(
    converted, tmp_path, capsys, caplog
):
    """num_nextn_predict_layers=1 on a checkpoint without the layer (every transformers save of
    DeepSeek-V3: 5.2x writes the count by default, no class builds the layer): the decoder is
    imported alone, gated, and said so in one line; export writes config.json back as it came,
    the count included, and no layer. A checkpoint that holds fewer layers than the decoder
    alone is refused as before."""
    import json

    hf = tmp_path / "hf"
    shutil.copytree(converted("v3")[0], hf)
    cfg = json.loads((hf / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (hf / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="porting.convert.hf_import"):
        assert main(["import", str(hf), "--out", str(out)]) == 0
    said = caplog.text
    assert (
        f"num_nextn_predict_layers=1, and no multi-token-prediction layer is stored after layer "
        f"{LAYERS - 1}" in said
    ), said
    assert "the decoder alone is imported" in said, said
    assert "MTP block" not in said, said  # the note of a layer that would be imported
    from porting.commands.demo import compare_hf_dirs
    from porting.testing import checkpoint_config

    assert not checkpoint_config(out).mtp_num_layers
    assert main(["export", str(out), "--out", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == cfg
    back = compare_hf_dirs(hf, tmp_path / "back")
    assert back.exact, back

    # a config whose decoder alone is longer than the checkpoint: refused, not read as MTP-less
    (hf / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": LAYERS + 1}))
    code = main(["import", str(hf), "--out", str(tmp_path / "out2"), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"num_hidden_layers is {LAYERS + 1} and 1 multi-token-prediction layer(s)" in err, err
    assert f"layers 0..{LAYERS - 1} ({LAYERS})" in err, err
    assert not (tmp_path / "out2").exists()
