"""SmolLM3 family: the full proof (porting.proof) on tiny random-init models with rotary-free
layers (by the default interval and by an explicit list, one with a window on them), the per-layer
rotary pinned by negative controls, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity).
"""

from __future__ import annotations

import pytest
import torch

from converters import smollm3
from porting import proof

LAYERS = 4
WINDOW = 8
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
)
VARIANTS = {
    # SmolLM3-3B's pattern: every 4th layer rotary-free (no_rope_layer_interval 4), tied
    "smollm3": dict(tie_word_embeddings=True),
    # the first and third layers rotary-free and sliding (layer_types derived from the list)
    "windowed": dict(no_rope_layers=[0, 1, 0, 1], use_sliding_window=True, sliding_window=WINDOW),
    "smollm3_bf16": dict(tie_word_embeddings=True, dtype=torch.bfloat16),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(d, "SmolLM3ForCausalLM", seed=len(v), **COMMON, **VARIANTS[v]),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def test_the_rotary_free_layers_are_megatrons_no_rope_list(converted):
    from porting.testing import checkpoint_config

    assert checkpoint_config(converted("smollm3")[1]).no_rope_freq == [0, 0, 0, 1]
    windowed = checkpoint_config(converted("windowed")[1])
    assert windowed.no_rope_freq == [1, 0, 1, 0]
    assert windowed.window_size == (WINDOW - 1, 0)
    assert windowed.window_attn_skip_freq == [1, 0, 1, 0]


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted(v)[1] for v in ("smollm3", "windowed")], tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    proof.prove_formats(converted("smollm3")[0], tmp_path)


def test_planted_fault_is_named(converted, tmp_path):
    hf, _ = converted("windowed")
    proof.prove_fault_named(hf, tmp_path / "ck", smollm3.FAMILY, 2, LAYERS)


@pytest.mark.parametrize(
    "changes",
    [{"no_rope_freq": None}, {"no_rope_freq": [1, 1, 1, 1]}, {"window_size": None}],
    ids=["rope_everywhere", "rope_nowhere", "no_window"],
)
def test_each_layer_kind_is_needed(changes, converted):
    """Negative controls: the windowed checkpoint run with every layer rotary, none, or no window
    moves the logits far past the tolerance."""
    from porting.parity import harness

    hf_dir, ckpt = converted("windowed")
    prompts = proof.prompts_of(ckpt)
    assert max(p.shape[1] for p in prompts) > 4 * WINDOW  # the window really cuts
    mc = proof.megatron_logits_with(ckpt, prompts, **changes)
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 100 * proof.ATOL


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"no_rope_layers": [1, 1, 0]}, ["no_rope_layers=[1, 1, 0]", "each of the 4 layers"]),
        ({"no_rope_layers": [1, 2, 1, 0]}, ["no_rope_layers=[1, 2, 1, 0]", "0 or 1"]),
        # the interval counts only where the list is left out (transformers writes the list)
        ({"no_rope_layers": None, "no_rope_layer_interval": 0}, ["no_rope_layer_interval=0"]),
        (
            {"layer_types": ["sliding_attention"] + ["full_attention"] * 3},
            ["use_sliding_window=False", "without a window"],
        ),
        ({"head_dim": None}, ["head_dim=None", "SmolLM3Attention"]),
        ({"model_type": "llama"}, ["model_type='llama'"]),
        ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["dynamic"]),
    ],
    ids=["short_list", "not_0_or_1", "zero_interval", "sliding_unswitched", "head_dim_null",
         "model_type", "activation", "dynamic"],
)  # fmt: skip
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("smollm3")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


def _rope_everywhere(config):
    layers = getattr(config, "no_rope_layers", None)
    return None if not layers or all(layers) else {"no_rope_layers": [1] * len(layers)}


@pytest.mark.parametrize("variant", ["smollm3", "windowed"])
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """The rotary-free layers, the window, its layers and rope_theta, each perturbed on the HF
    side alone, move the gate's logits past its tolerance, or the gate's report names them."""
    features = proof.FEATURES | {"no_rope_layers": _rope_everywhere}
    seen, report = proof.prove_features_named(*converted(variant), features=features)
    assert report.passed and report.unobserved == []
    assert {"no_rope_layers", "rope_theta"} <= set(seen.observed)
    assert ("sliding_window" in seen.observed) == (variant == "windowed")
