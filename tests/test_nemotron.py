"""Nemotron family: the full proof (porting.proof) on tiny random-init models, each
Nemotron-specific piece pinned (the ``1 + w`` norm and its bias by planted faults, the squared
ReLU and the rotated width by negative controls), and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). The
norm weights and biases are moved off their init (make_hf), so a norm read as ``w`` rather than
``1 + w``, or a dropped bias, fails parity.
"""

from __future__ import annotations

import pytest
import torch

from converters import nemotron
from porting import proof

LAYERS = 3
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    max_position_embeddings=256,
    hidden_act="relu2",
    norm_eps=1e-5,
)
VARIANTS = {
    # Minitron-8B's shape: grouped KV heads, heads wider than hidden / heads, half rotated
    "minitron": dict(num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True, partial_rotary_factor=0.25),
    "biases": dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "minitron_bf16": dict(num_key_value_heads=2, head_dim=32, dtype=torch.bfloat16),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(d, "NemotronForCausalLM", seed=len(v), **COMMON, **VARIANTS[v]),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("minitron", "biases")], tmp_path)


@pytest.mark.parametrize("variant", ["minitron", "mha_tied", "biases", "minitron_bf16"])
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    proof.prove_formats(converted("minitron")[0], tmp_path)


@pytest.mark.parametrize(
    "pattern",
    [
        "input_layernorm.weight",
        "input_layernorm.bias",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
    ],
)
def test_planted_fault_is_named(pattern, converted, tmp_path):
    hf, _ = converted("biases")
    proof.prove_fault_named(hf, tmp_path / "ck", nemotron.FAMILY, 1, LAYERS, pattern)


@pytest.mark.parametrize(
    "changes",
    [
        # the norm read as plain LayerNorm (w, not 1 + w)
        {"layernorm_zero_centered_gamma": False},
        # a gated MLP would not even load; the other activation Megatron's GPT knows
        {"activation_func": torch.nn.functional.relu},
        # the whole head rotated, as a Llama would
        {"rotary_percent": 1.0},
    ],
    ids=["plain_norm", "relu", "full_rotary"],
)
def test_each_nemotron_piece_is_needed(changes, converted):
    """Negative controls: the checkpoint run with one piece of the maths replaced by its usual
    GPT form moves the logits far past the tolerance."""
    from porting.parity import harness

    hf_dir, ckpt = converted("minitron")
    prompts = proof.prompts_of(ckpt)
    if "layernorm_zero_centered_gamma" in changes:
        mc = proof.megatron_logits_with(ckpt, prompts, transformer_layer_spec=_plain_norm_spec)
    else:
        mc = proof.megatron_logits_with(ckpt, prompts, **changes)
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, [m[..., : hf[0].shape[-1]] for m in mc])
    assert not report.passed and report.max_abs_diff > 100 * proof.ATOL


def _plain_norm_spec(config, vp_stage=None):
    from models import nemotron as model

    class PlainLayerNorm(model.LayerNorm1P):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, self.shape, self.weight, self.bias, self.eps)

    spec = model.nemotron_block_spec(config, vp_stage)
    for layer in spec.submodules.layer_specs:
        layer.submodules.input_layernorm = PlainLayerNorm
        layer.submodules.pre_mlp_layernorm = PlainLayerNorm
    spec.submodules.layer_norm = PlainLayerNorm
    return spec


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"hidden_act": "silu"}, ["hidden_act='silu'", "relu2"]),
        ({"model_type": "llama"}, ["model_type='llama'"]),
        ({"attention_bias": True}, ["attention_bias=True", "mlp_bias=False"]),
        ({"partial_rotary_factor": 0.3}, ["partial_rotary_factor=0.3", "9 channels"]),
        ({"partial_rotary_factor": 0}, ["partial_rotary_factor=0", "(0, 1]"]),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling", "5.x applies"]),
        ({"kv_channels": 16}, ["kv_channels=16", "32"]),
        ({"num_key_value_heads": None}, ["num_key_value_heads=None"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads=3"]),
        ({"layer_norm_eps": 1e-5}, ["layer_norm_eps"]),
    ],
    ids=[
        "activation", "model_type", "bias_mix", "odd_rotary", "no_rotary", "rope_scaling",
        "kv_channels", "kv_heads_null", "kv_heads", "unknown_field",
    ],
)  # fmt: skip
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("minitron")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


def test_kv_channels_as_nvidia_converted_them_is_carried(tmp_path):
    """NVIDIA's NeMo-to-HF script writes Megatron's ``kv_channels`` beside ``head_dim``
    (Minitron's configs): transformers never reads it; equal to the head width, it is carried
    and comes back in ``config.json``."""
    hf = proof.make_hf(
        tmp_path / "hf", "NemotronForCausalLM", **COMMON, num_key_value_heads=2, head_dim=32
    )
    proof.prove_round_trip(hf, _imported_with(hf, tmp_path, kv_channels=32), tmp_path / "back")


def _imported_with(hf, tmp_path, **fields):
    import json

    from porting.api import import_hf

    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(cfg | fields, indent=2))
    assert import_hf(hf, tmp_path / "ckpt", verify=True, show_progress=False).passed
    return tmp_path / "ckpt"


def _half_rotary(config):
    factor = getattr(config, "partial_rotary_factor", None)
    return None if factor is None else {"partial_rotary_factor": factor / 2}


@pytest.mark.parametrize("variant", ["minitron", "mha_tied"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each mapped feature (rope_theta, the rotated width), perturbed on the HF side alone, moves
    the gate's logits past its tolerance, or the gate's report names it."""
    features = proof.FEATURES | {"partial_rotary_factor": _half_rotary}
    seen, report = proof.prove_features_named(*converted(variant), features=features)
    assert report.passed and report.unobserved == []
    assert {"rope_theta", "partial_rotary_factor"} <= set(seen.observed)


def test_the_planner_reads_minitron_as_the_model_transformers_builds():
    """`porting plan --model` on Minitron-8B's config: the squared-ReLU MLP ungated, 48 heads of
    128 over a width of 4096; its parameter count within 0.01% of the one transformers builds
    (the planner counts RMSNorm-sized norms: the LayerNorms' biases, 0.003%, are the difference)."""
    import importlib.util
    from pathlib import Path

    import transformers

    from porting.planner.model import from_hf_config

    spec = importlib.util.spec_from_file_location(
        "published_configs", Path(__file__).with_name("published_configs.py")
    )
    published = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(published)
    cfg = published.PUBLISHED["nvidia/Minitron-8B-Base"]
    shape = from_hf_config(cfg, "config.json")
    assert not shape.gated and shape.head_dim == 128 and shape.heads == 48
    with torch.device("meta"):
        model = transformers.NemotronForCausalLM(transformers.NemotronConfig(**cfg))
    built = sum(p.numel() for p in model.parameters())
    assert shape.total_params() == pytest.approx(built, rel=1e-4)
