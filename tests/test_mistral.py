"""Mistral family: the full proof (porting.proof) with a sliding window shorter than the prompts,
the window's exact width pinned by two negative controls, and the configs it refuses.

Tolerance: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity).
"""

from __future__ import annotations

import pytest
import torch

from converters import mistral
from porting import proof

WINDOW = 8
COMMON = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
VARIANTS = {
    "window": dict(sliding_window=WINDOW),
    "no_window": dict(sliding_window=None),
    "tied": dict(sliding_window=WINDOW, tie_word_embeddings=True, head_dim=32),
    "bf16": dict(sliding_window=WINDOW, dtype=torch.bfloat16),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(
        tmp_path_factory,
        lambda d, v: proof.make_hf(d, "MistralForCausalLM", seed=len(v), **COMMON, **VARIANTS[v]),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers(variant, converted):
    hf, ckpt = converted(variant)
    prompts = proof.prompts_of(ckpt)
    assert max(p.shape[1] for p in prompts) > 4 * WINDOW  # the window really cuts
    proof.prove_parity(hf, ckpt, prompts)


@pytest.mark.parametrize("window_size", [None, (WINDOW, 0), (WINDOW - 2, 0)])
def test_the_window_width_is_exact(window_size, converted):
    """The checkpoint run with no window, or one key wider or narrower, must fail parity."""
    from porting.convert.megatron import (
        build_mcore_model,
        init_parallel,
        load_weights,
        mcore_logits,
    )
    from porting.parity import harness
    from porting.testing import checkpoint_config

    hf_dir, ckpt = converted("window")
    assert checkpoint_config(ckpt).window_size == (WINDOW - 1, 0)
    init_parallel()
    config = checkpoint_config(ckpt)
    config.window_size = window_size
    model = build_mcore_model(config)
    load_weights(model, ckpt)
    prompts = proof.prompts_of(ckpt)
    mc = [mcore_logits(model.float(), p)[..., :130] for p in prompts]
    hf, _ = proof.logits(hf_dir, ckpt, prompts)
    report = harness.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 1e-3


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted("window")[1], converted("tied")[1]], tmp_path)


@pytest.mark.parametrize("variant", ["window", "no_window", "bf16"])
def test_round_trip_is_exact(variant, converted, tmp_path):
    proof.prove_round_trip(*converted(variant), tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    proof.prove_formats(converted("window")[0], tmp_path)


def test_planted_fault_is_named(converted, tmp_path):
    hf, _ = converted("window")
    proof.prove_fault_named(hf, tmp_path / "ck", mistral.FAMILY, 2, 3, "mlp.linear_fc2.weight")


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"sliding_window": 0}, ["sliding_window=0", "positive integer"]),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            ["rope_scaling", "dynamic"],
        ),
        ({"model_type": "llama"}, ["model_type='llama'"]),
        ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
    ],
    ids=["zero_window", "rope_scaling", "model_type", "gelu"],
)
def test_config_lint_names_the_field(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("window")[0], changes, tmp_path)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """The window (and rope_theta), perturbed on the HF side alone, move the gate's logits past
    1e-5, or the gate's report names them."""
    seen, report = proof.prove_features_named(*converted(variant))
    assert report.passed and report.unobserved == []
    assert ("sliding_window" in seen.observed) == (variant != "no_window")
