"""RoPE as published (issue 36): every ``rope_scaling`` the Llama-layout families' checkpoints
ship is converted with full-logit parity against ``transformers`` or refused in one line naming
what Megatron-Core lacks.

Parity: fp32, atol=rtol=1e-5 on every logit, 100% top-1 (porting.proof.assert_parity). The tiny
models keep ``max_position_embeddings`` 256 and put ``original_max_position_embeddings`` at half
of it, so YaRN's correction range falls inside a 16-wide head: some channel pairs keep their
frequency, some are interpolated, some blended (the negative control shows the gate sees it).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from converters.llama import _rope_to_mcore
from models.llama import yarn_inv_freq
from porting import proof

LLAMA, QWEN2 = "LlamaForCausalLM", "Qwen2ForCausalLM"
MAX_POSITIONS = proof.tiny_fields(LLAMA)["max_position_embeddings"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POSITIONS // 2}
# Qwen2.5-7B-Instruct's model card block for contexts past 32K (tests/published_configs.py), as
# written there: the legacy "type" alone, an original length longer than the tiny model's
QWEN25_CARD = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}

VARIANTS = {
    "llama_yarn": (LLAMA, YARN),
    "qwen2_yarn": (QWEN2, YARN),
    # the attention factor from the mscale ratio (DeepSeek-style keys), and given outright
    "llama_yarn_mscale": (LLAMA, YARN | {"mscale": 1.0, "mscale_all_dim": 0.5}),
    "qwen2_yarn_attention_factor": (QWEN2, YARN | {"attention_factor": 1.25}),
    # another correction range, its ends not rounded
    "llama_yarn_betas": (LLAMA, YARN | {"beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}),
    "qwen2_card": (QWEN2, QWEN25_CARD),
}


def _as_published(hf, rope_scaling: dict):
    """transformers' save_pretrained adds rope_type next to a legacy type: put the object back
    as the checkpoint's author wrote it."""
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_scaling"] = rope_scaling
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


def _make(directory, variant: str):
    arch, rope = VARIANTS[variant]
    hf = proof.make_hf(
        directory, arch, seed=len(variant), **proof.tiny_fields(arch), rope_scaling=dict(rope)
    )
    return _as_published(hf, rope)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, ckpt)``, each built and imported once per module."""
    return proof.imported_variants(tmp_path_factory, _make)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_yarn_parity_against_transformers(variant, converted):
    proof.prove_parity(*converted(variant))


def test_yarn_config_reaches_megatron(converted):
    from porting.testing import checkpoint_config

    config = checkpoint_config(converted("llama_yarn_mscale")[1])
    attention = (0.1 * math.log(4.0) + 1) / (0.1 * 0.5 * math.log(4.0) + 1)
    assert config.rope_scaling_type == "yarn"
    assert config.rope_scaling_original_max_position_embeddings == MAX_POSITIONS // 2
    assert math.isclose(config.rope_scaling_attention_factor, attention)
    assert math.isclose(config.softmax_scale, attention**2 / math.sqrt(config.kv_channels))


def test_dropping_yarn_fails_parity_by_far(converted, tmp_path):
    """Negative control: the same weights imported with rope_scaling null are 100x and more off
    the YaRN model on the gate's prompts (short texts and one random-id prompt)."""
    from porting.api import import_hf

    hf, _ = converted("llama_yarn")
    plain = _as_published(shutil.copytree(hf, tmp_path / "hf"), None)
    import_hf(plain, tmp_path / "nemo", verify=False, show_progress=False)
    ref, got = proof.logits(hf, tmp_path / "nemo")
    worst = max((a - b).abs().max().item() for a, b in zip(ref, got, strict=True))
    assert worst > 100 * proof.ATOL, worst


def test_export_gives_the_published_object_back(converted, tmp_path):
    """The card's object (legacy type only) comes back key for key: nothing added."""
    hf, ckpt = converted("qwen2_card")
    proof.prove_round_trip(hf, ckpt, tmp_path / "back")
    assert (
        json.loads((tmp_path / "back" / "config.json").read_text())["rope_scaling"] == QWEN25_CARD
    )


# ---------------------------------------------------------------------------------------------
# The objects read without a model


@pytest.mark.parametrize(
    "rope",
    [
        YARN,
        QWEN25_CARD,
        {"type": "yarn", "rope_type": "yarn", "factor": 4.0},  # original absent
        # transformers 5 cannot build this one (its refusal: the test after next)
        pytest.param(
            YARN | {"original_max_position_embeddings": None, "attention_factor": None},
            marks=pytest.mark.nemo2,
        ),
        YARN | {"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
        YARN | {"mscale": 1.0, "mscale_all_dim": 0.5},
        YARN | {"mscale": 1.0},  # transformers takes the ratio only when both are set
        YARN | {"factor": 1.0},
    ],
)
@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (128, 1e6)])
def test_yarn_frequencies_and_factor_are_transformers(rope, head_dim, theta):
    """Our YaRN maths, written from the formula, gives transformers' numbers bit for bit."""
    import transformers
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    hf = {"rope_scaling": rope, "max_position_embeddings": MAX_POSITIONS}
    got = _rope_to_mcore(hf)
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=theta,
        rope_scaling=dict(rope),
    )
    want_freq, want_factor = _compute_yarn_parameters(config, "cpu")
    freq = yarn_inv_freq(
        dim=head_dim,
        base=theta,
        factor=got["rope_scaling_factor"],
        original_max_position_embeddings=got["rope_scaling_original_max_position_embeddings"],
        beta_fast=got["rope_scaling_beta_fast"],
        beta_slow=got["rope_scaling_beta_slow"],
        truncate=got["rope_scaling_truncate"],
    )
    assert torch.equal(freq, want_freq)
    assert got["rope_scaling_attention_factor"] == want_factor


@pytest.mark.parametrize(
    "rope,want",
    [
        (None, {"rope_scaling_type": None}),
        ({"rope_type": "default"}, {"rope_scaling_type": None}),
        ({"type": "default", "rope_type": "default"}, {"rope_scaling_type": None}),
        (
            {"type": "linear", "rope_type": "linear", "factor": 4.0},
            {"rope_scaling_type": "linear", "seq_len_interpolation_factor": 4.0},
        ),
        ({"type": "linear", "factor": 4}, {"seq_len_interpolation_factor": 4.0}),
    ],
)
def test_no_scaling_and_linear_as_transformers_writes_them(rope, want):
    got = _rope_to_mcore({"rope_scaling": rope, "max_position_embeddings": MAX_POSITIONS})
    assert got.items() >= want.items(), got


# ---------------------------------------------------------------------------------------------
# Refusals: one line, naming the key or type and what Megatron-Core lacks

LONGROPE = {
    "rope_type": "longrope",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "short_factor": [1.0] * 8,
    "long_factor": [2.0] * 8,
}
REFUSED = [
    pytest.param(
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        ["'dynamic'", "running sequence length", "Megatron-Core", "one frequency table"],
        id="dynamic",
    ),
    pytest.param(
        {"rope_scaling": LONGROPE},
        ["'longrope'", "short_factor", "long_factor", "Megatron-Core"],
        id="longrope",
    ),
    pytest.param(
        {"rope_scaling": {"rope_type": "ntk-by-parts", "factor": 2.0}},
        ["'ntk-by-parts'", "Megatron-Core", "'yarn'"],
        id="unknown_type",
    ),
    pytest.param(
        {"rope_scaling": YARN | {"beta_fats": 32.0}},
        ["'beta_fats'", "'yarn'", "beta_fast"],
        id="yarn_unknown_key",
    ),
    pytest.param(
        {"rope_scaling": {"type": "linear", "rope_type": "yarn", "factor": 4.0}},
        ["rope_scaling.type ('linear')", "rope_type ('yarn')", "disagree"],
        id="type_disagrees",
    ),
    pytest.param(
        {"rope_scaling": YARN | {"factor": 0.5}},
        ["rope_scaling.factor", ">= 1", "0.5"],
        id="yarn_factor_below_1",
    ),
    pytest.param(
        {"rope_scaling": {"rope_type": "linear", "factor": 0.5}},
        ["rope_scaling.factor", ">= 1", "0.5"],
        id="linear_factor_below_1",
    ),
    pytest.param(
        {"rope_scaling": YARN | {"beta_fast": 1.0, "beta_slow": 4.0}},
        ["beta_fast (1.0)", "beta_slow (4.0)"],
        id="yarn_betas_crossed",
    ),
    pytest.param(
        {"rope_scaling": YARN | {"attention_factor": 0.0}},
        ["rope_scaling.attention_factor", "> 0"],
        id="yarn_attention_factor_0",
    ),
    pytest.param(
        {"rope_scaling": YARN | {"truncate": None}},
        ["rope_scaling.truncate", "true or false"],
        id="yarn_truncate_null",
    ),
    pytest.param(
        {"rope_scaling": {"factor": 4.0}},
        ["rope_scaling.rope_type", "None"],
        id="no_type",
    ),
    pytest.param(
        {"partial_rotary_factor": 0.5},
        ["partial_rotary_factor=0.5", "whole head", "1.0"],
        id="partial_rotary_0.5",
    ),
]


@pytest.mark.parametrize("changes,needles", REFUSED)
def test_refused_naming_what_megatron_lacks(changes, needles, converted, tmp_path):
    err = proof.refused_import(converted("llama_yarn")[0], changes, tmp_path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_partial_rotary_factor_1_is_carried(converted, tmp_path):
    """The no-op value imports, keeps parity and comes back on export."""
    from porting.api import import_hf

    hf = shutil.copytree(converted("qwen2_yarn")[0], tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text()) | {"partial_rotary_factor": 1.0}
    (hf / "config.json").write_text(json.dumps(cfg))
    import_hf(hf, tmp_path / "nemo", verify=False, show_progress=False)
    proof.prove_parity(hf, tmp_path / "nemo")
    proof.prove_round_trip(hf, tmp_path / "nemo", tmp_path / "back")


def test_megatron_lm_layout_refuses_a_scaling_it_cannot_record(converted, tmp_path, capsys):
    """Megatron-LM rebuilds the rotary embedding from the checkpoint's arguments, none of which
    carries a scaling: the layout refuses rather than write a model Megatron-LM would run
    unscaled, and nothing is left behind."""
    from porting.cli import main

    hf, _ = converted("llama_yarn")
    out = tmp_path / "mlm"
    code = main(["import", str(hf), "--out", str(out), "--format", "megatron-lm", "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2 and "rotary scaling 'yarn'" in err and "--format nemo2" in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".mlm")]


@pytest.mark.parametrize(
    "rope",
    [None, {"rope_type": "linear", "factor": 2.0}, YARN],
    ids=["null", "linear", "yarn"],
)
def test_mistral_takes_the_shared_rotary_types(rope, tmp_path):
    """transformers' Mistral reads rope_scaling through the same rotary functions as Llama."""
    from porting.api import import_hf

    arch = "MistralForCausalLM"
    # transformers 4.57's YaRN reads config.head_dim, which MistralConfig leaves None unless given
    # (Mistral-Nemo gives it): its own model cannot run YaRN without one
    fields = proof.tiny_fields(arch) | ({"head_dim": 16} if rope is YARN else {})
    hf = proof.make_hf(tmp_path / "hf", arch, **fields, rope_scaling=rope)
    import_hf(hf, tmp_path / "nemo", verify=False, show_progress=False)
    proof.prove_parity(hf, tmp_path / "nemo")


def _refused_as_unbuildable(changes: dict, tmp_path) -> str:
    arch = "MistralForCausalLM"
    hf = proof.make_hf(tmp_path / "hf", arch, **proof.tiny_fields(arch))
    said = proof.refused_import(hf, changes, tmp_path / "w")
    assert "transformers' MistralForCausalLM cannot be built from this config" in said, said
    assert "Traceback" not in said
    return said


@pytest.mark.nemo2
def test_a_config_transformers_4_cannot_build_is_refused_in_one_line(tmp_path):
    """transformers 4.57's YaRN multiplies config.head_dim, which MistralConfig leaves None: the
    reference cannot run, so the import stops naming that, before anything is written."""
    _refused_as_unbuildable({"rope_scaling": YARN, "head_dim": None}, tmp_path)


def test_a_config_transformers_5_cannot_build_is_refused_with_its_reason(tmp_path):
    """transformers 5 refuses YaRN without an original length (4.57 took the model's): the
    import stops naming that and the reason its validator wraps, before anything is written."""
    said = _refused_as_unbuildable(
        {"rope_scaling": YARN | {"original_max_position_embeddings": None}}, tmp_path
    )
    assert "validate_rope" in said and "TypeError: unsupported operand" in said, said


@pytest.mark.parametrize("variant", ["llama_yarn", "qwen2_card"])
def test_the_gate_sees_the_scaling(variant, converted):
    """rope_scaling perturbed away on the HF side alone moves the gate's logits past 1e-5."""
    seen, report = proof.prove_features_named(*converted(variant))
    assert "rope_scaling" in seen.observed and report.unobserved == []
