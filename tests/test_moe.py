"""MoE family (Mixtral, Qwen2-MoE, Qwen3-MoE): the full proof (porting.proof) on tiny random-init
models, the routing decisions compared token by token, the expert-permutation negative control,
and the configs and checkpoints it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). Ties in
routing are avoided by construction: the router weights are scaled up (x30) so that the k-th and
(k+1)-th router logits of every token are far apart (checked: > 1e-4, a hundred times the fp32
rounding of these logits), and rounding cannot swap an expert.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import moe
from porting import proof
from porting.cli import main

LAYERS, EXPERTS = 3, 4
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
QWEN_MOE = dict(num_experts=EXPERTS, moe_intermediate_size=48)
VARIANTS = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=EXPERTS)),
    "mixtral_window": (
        "MixtralForCausalLM",
        dict(num_local_experts=EXPERTS, sliding_window=8, tie_word_embeddings=True),
    ),
    "qwen2_moe": ("Qwen2MoeForCausalLM", QWEN_MOE | dict(shared_expert_intermediate_size=80)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", QWEN_MOE | dict(norm_topk_prob=True, head_dim=32)),
    "qwen3_moe_bf16": (
        "Qwen3MoeForCausalLM",
        QWEN_MOE | dict(norm_topk_prob=True, head_dim=32, dtype=torch.bfloat16),
    ),
}
ROUTERS = {"MixtralForCausalLM": "block_sparse_moe.gate"}


def _router(arch: str) -> str:
    return ROUTERS.get(arch, "mlp.gate")


def _widen_routers(arch):
    def edit(model):
        for name, mod in model.named_modules():
            if name.endswith(_router(arch)):
                mod.weight.mul_(30.0)

    return edit


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""

    def make(directory, variant):
        arch, fields = VARIANTS[variant]
        edit = _widen_routers(arch)
        return proof.make_hf(directory, arch, seed=len(variant), edit=edit, **COMMON, **fields)

    return proof.imported_variants(tmp_path_factory, make)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_routing_decisions_match_token_by_token(variant, converted):
    proof.prove_routing(*converted(variant), _router(VARIANTS[variant][0]))


def test_the_variants_route_as_hf_does(converted):
    """Softmax order per layout, shared expert and its gate, expert count and size."""
    from porting.testing import checkpoint_config

    expected = {
        "mixtral": (False, None, False),
        "qwen2_moe": (True, 80, True),  # norm_topk_prob false: top-k of the full softmax
        "qwen3_moe": (False, None, False),
    }
    for variant, (pre_softmax, shared, gate) in expected.items():
        config = checkpoint_config(converted(variant)[1])
        assert config.num_moe_experts == EXPERTS and config.moe_router_topk == 2
        assert config.moe_router_pre_softmax == pre_softmax, variant
        assert config.moe_shared_expert_intermediate_size == shared, variant
        assert config.moe_shared_expert_gate == gate, variant
        assert config.moe_ffn_hidden_size == (96 if variant == "mixtral" else 48)


# Mixtral under transformers 4.57, whose experts are modules the gate loads one by one; Qwen2-MoE
# under transformers 5, whose two stacks per layer it reads one expert's slice at a time
@pytest.mark.parametrize("variant", [pytest.param("mixtral", marks=pytest.mark.nemo2), "qwen2_moe"])
def test_the_gate_holds_one_expert_at_a_time(variant, converted):
    proof.prove_experts_streamed(*converted(variant))


def _qwen3_coder_layer(experts: int) -> dict:
    """One layer at Qwen3-Coder-480B-A35B's widths (hidden 6144, experts of 2560, 96 heads)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 32000,
        "hidden_size": 6144,
        "intermediate_size": 8192,
        "moe_intermediate_size": 2560,
        "num_hidden_layers": 1,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
    }


def test_the_gates_memory_bound_does_not_grow_with_the_experts():
    from porting.convert.preflight import (
        GATE_LAYER_BYTES,
        GATE_POSITIONS,
        VOCAB_SLICE_BYTES,
        gate_memory,
    )
    from porting.convert.table_check import hf_meta_shapes
    from porting.parity import harness, sides, vocab

    # the bound's constants are the gate's own
    assert GATE_POSITIONS == (len(harness.PROMPT_TEXTS) + 1) * harness.RANDOM_PROMPT_LEN
    assert vocab.SLICE_BYTES == VOCAB_SLICE_BYTES and sides.LAYER_BYTES == GATE_LAYER_BYTES
    h, f, vocab_size = 6144, 2560, 32000
    needs = []
    attention = h * 96 * 128 * 2 + h * 8 * 128 * 2 + 2 * 128  # q, o; k, v; the q/k norms
    for n in (160, 320):
        shapes = hf_meta_shapes(moe.FAMILY, _qwen3_coder_layer(n))
        need, part = gate_memory(shapes, tied=False)
        assert part["two experts"] == 2 * 4 * 3 * h * f
        # the tables by slices of 128 MiB, never whole (786 MB each here)
        assert part["two slices of the embedding or output layer"] == 2 * VOCAB_SLICE_BYTES
        assert part["the logits of the prompts"] == 2 * 4 * GATE_POSITIONS * vocab_size
        assert part["the rest outside the layers"] == 4 * h  # the final norm
        # the layer (653 MB without its experts) is read by modules: its vectors (two norms,
        # the q/k norms) two at a time, and two modules, the computing one and the next: at
        # most its three largest matrices (q, o; k), where the router (a row an expert, the one
        # term that grows with them) is not
        vectors = 2 * 4 * (2 * h + 2 * 128)
        assert part["two layers without their experts"] == vectors
        modules = 4 * (2 * h * 96 * 128 + h * 8 * 128)
        assert part["two modules' matrices of a layer read by modules"] == modules
        assert 4 * attention > GATE_LAYER_BYTES and n * h < h * 8 * 128
        # the layers outweigh the slices: held in turn, not together
        logits = part["the logits of the prompts"]
        assert need == 4 * h + logits + vectors + modules + 2 * 4 * 3 * h * f
        needs.append(need)
        # tied, the one table is read by slices the same way: nothing added
        assert gate_memory(shapes, tied=True)[0] == need
    assert needs[0] == needs[1]


def test_the_gates_bound_reads_a_frontier_dense_layer_by_modules():
    """DeepSeek-V3's dense layer (FFN 18432: 583M parameters, 2.3 GB in fp32) and its MoE
    layers (0.93 GB without their experts) are over the gate's layer size: their matrices count
    two modules at a time (the largest pair, Megatron's fused gate and up of 2 x 18432 x 7168,
    and the down projection read meanwhile), their vectors twice."""
    import copy
    import importlib.util
    from pathlib import Path

    from converters import deepseek
    from porting.convert.preflight import GATE_LAYER_BYTES, gate_memory
    from porting.convert.table_check import hf_meta_shapes

    spec = importlib.util.spec_from_file_location(
        "published_configs", Path(__file__).with_name("published_configs.py")
    )
    published = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(published)
    config = copy.deepcopy(published.PUBLISHED["deepseek-ai/DeepSeek-V3"])
    config |= {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 16}
    config.pop("quantization_config")
    shapes = hf_meta_shapes(deepseek.FAMILY, config)
    h, ffn = 7168, 18432
    dense = sum(4 * _n(s) for k, s in shapes.items() if k.startswith("model.layers.0."))
    assert dense > GATE_LAYER_BYTES
    need, part = gate_memory(shapes, tied=False)
    assert part["two modules' matrices of a layer read by modules"] == 3 * 4 * ffn * h
    moe_layer = sum(
        4 * _n(s)
        for k, s in shapes.items()
        if k.startswith("model.layers.1.") and ".experts." not in k
    )
    assert moe_layer > GATE_LAYER_BYTES
    vectors = max(
        sum(4 * _n(s) for k, s in shapes.items() if k.startswith(f"model.layers.{i}.")
            and ".experts." not in k and len(s) < 2)
        for i in (0, 1)
    )  # fmt: skip
    assert part["two layers without their experts"] == 2 * vectors
    assert part["two experts"] == 2 * 4 * 3 * h * 2048
    # the vocabulary tables by slices: 3.7 GB each in fp32, 256 MiB at a time
    assert part["two slices of the embedding or output layer"] == 256 << 20
    # held at once: the vectors two at a time, two modules, two experts, beside the logits and
    # the final norm (the slices come after the layers, in their areas)
    held = 2 * vectors + 3 * 4 * ffn * h + part["two experts"]
    assert need == held + part["the logits of the prompts"] + part["the rest outside the layers"]
    assert need < 2.3e9


def _n(shape) -> int:
    return int(torch.Size(shape).numel())


def test_a_gate_larger_than_free_memory_is_refused_before_anything_is_written(
    converted, tmp_path, capsys, monkeypatch
):
    from porting.convert import preflight

    hf, ckpt = converted("qwen3_moe")
    monkeypatch.setattr(preflight, "available_bytes", lambda: 100_000)
    monkeypatch.setattr(preflight, "check_largest_tensor", lambda *a: None)
    out = tmp_path / "out"
    assert main(["import", str(hf), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    for needle in (
        "the parity gate of import needs about",
        "two experts",
        "97.7 KiB free",
        "--no-verify",
    ):
        assert needle in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert main(["verify", str(hf), str(ckpt)]) == 2
    assert "the parity gate of verify needs about" in capsys.readouterr().err
    assert main(["import", str(hf), "--out", str(out), "--no-verify"]) == 0
    assert out.exists()


def test_experts_split_unevenly_over_shards_import_with_the_gate_and_come_back(converted, tmp_path):
    """Each expert's three matrices in different shards, one expert's alone in a shard of its
    own, the router apart from its experts: the import reads each by the index, its gate
    passes, and the export gives back every tensor bit for bit."""
    import json

    hf = tmp_path / "hf"
    shutil.copytree(converted("qwen3_moe")[0], hf)
    tensors = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()

    def shard(key: str) -> str:
        if ".experts.1." in key:
            return "c"
        if key.endswith("gate_proj.weight") or key.endswith("mlp.gate.weight"):
            return "a" if ".layers.0." in key else "b"
        return "b" if ".experts." in key else "a"

    shards: dict[str, dict] = {}
    for key, t in tensors.items():
        shards.setdefault(shard(key), {})[key] = t
    weight_map = {}
    for name, part in shards.items():
        file = f"model-{name}.safetensors"
        save_file(part, hf / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert len(shards) == 3
    assert main(["import", str(hf), "--out", str(tmp_path / "ck")]) == 0
    proof.prove_round_trip(hf, tmp_path / "ck", tmp_path / "back")


def test_permuted_experts_fail_and_the_layer_is_named(converted, tmp_path):
    """Experts 0 and 1 of layer 1 swapped in the table: parity fails there."""
    hf, _ = converted("mixtral")
    table = proof.swapped_experts_table(moe.WEIGHTS, 1, 0, 1, LAYERS, EXPERTS)
    proof.prove_table_fault_named(hf, tmp_path / "ck", moe.FAMILY, table, 1)


@pytest.mark.parametrize(
    "variant,pattern",
    [("qwen2_moe", "shared_experts.linear_fc2.weight"), ("qwen3_moe", "mlp.router.weight")],
)
def test_planted_fault_is_named(variant, pattern, converted, tmp_path):
    hf, _ = converted(variant)
    proof.prove_fault_named(hf, tmp_path / "ck", moe.FAMILY, 2, LAYERS, pattern)


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("mixtral", "qwen2_moe")], tmp_path)


@pytest.mark.parametrize("variant", ["mixtral_window", "qwen2_moe", "qwen3_moe_bf16"])
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    proof.prove_formats(converted("qwen2_moe")[0], tmp_path)


def _damaged(converted, tmp_path, variant, change):
    hf = tmp_path / "hf"
    shutil.copytree(converted(variant)[0], hf)
    tensors = load_file(hf / "model.safetensors")
    change(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize(
    "change,needles",
    [
        (
            lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
            ["missing from the checkpoint", "layers.1.block_sparse_moe.experts.3.w2.weight"],
        ),
        (
            lambda t: t.update(
                {"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(96, 64)}
            ),
            ["config.json: num_local_experts is 4", "hold experts 0..4 (5)"],
        ),
        (
            lambda t: t.update({"model.layers.2.block_sparse_moe.gate.weight": torch.zeros(5, 64)}),
            ["model.safetensors", "layers.2.block_sparse_moe.gate.weight", "(5, 64)", "(4, 64)"],
        ),
    ],
    ids=["missing_expert", "extra_expert", "router_shape"],
)
def test_damaged_moe_checkpoint_is_located_and_nothing_written(
    change, needles, converted, tmp_path, capsys, monkeypatch
):
    from porting.convert.safetensors_io import SafetensorsSource

    hf = _damaged(converted, tmp_path, "mixtral", change)

    def no_reads(self, key):
        raise AssertionError(f"{key} read before the checkpoint was checked")

    monkeypatch.setattr(SafetensorsSource, "get", no_reads)
    out = tmp_path / "out"
    code = main(["import", str(hf), "--out", str(out), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2, err
    for needle in needles:
        assert needle in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize(
    "variant,changes,needles",
    [
        ("mixtral", {"num_local_experts": 5}, ["num_local_experts is 5", "experts 0..3 (4)"]),
        ("qwen2_moe", {"decoder_sparse_step": 2}, ["decoder_sparse_step=2", "dense"]),
        ("qwen2_moe", {"mlp_only_layers": [1]}, ["mlp_only_layers=[1]"]),
        ("qwen2_moe", {"use_sliding_window": True}, ["use_sliding_window=True"]),
        ("qwen3_moe", {"attention_bias": True}, ["attention_bias=True"]),
        ("qwen2_moe", {"num_local_experts": 4}, ["num_local_experts are not Qwen-MoE fields"]),
        # Qwen3-MoE's 5.x name for num_experts, beside its 4.x one (porting.contract.hf_spelling)
        ("qwen3_moe", {"num_local_experts": 4}, ["both num_local_experts (transformers 5) and"]),
        ("mixtral", {"num_experts_per_tok": 0}, ["num_experts_per_tok=0"]),
        ("mixtral", {"router_jitter_noise": 1.5}, ["router_jitter_noise=1.5"]),
        ("mixtral", {"model_type": "qwen2_moe"}, ["model_type='qwen2_moe'"]),
    ],
    ids=[
        "expert_count",
        "sparse_step",
        "mlp_only",
        "window",
        "o_bias",
        "wrong_field",
        "both_spellings",
        "topk0",
        "jitter",
        "model_type",
    ],
)
def test_config_lint_names_the_field(variant, changes, needles, converted, tmp_path):
    err = proof.refused_import(converted(variant)[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each mapped feature (rope_theta, a window, ...), perturbed on the HF side alone, moves the
    gate's logits past its tolerance, or the gate's report names it."""
    _, report = proof.prove_features_named(*converted(variant)[:2])
    assert report.passed
