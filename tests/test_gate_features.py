"""The parity gate says what it could not see (issue 36, part 5).

At test sizes Gemma 2's published soft-caps (50 on scores, 30 on logits), its GELU variant and a
4096-token window move a tiny model's logits by less than the gate's tolerance, so a conversion
that dropped them would pass. Each test here pins one side of that: what
``porting.proof.prove_features_observed`` measures by perturbing the HF config alone, what the
gate's ``unobserved`` list names, and that a gate on a conversion which really dropped a feature
fails when the feature is in reach and passes, saying so, when it is not.
"""

from __future__ import annotations

import json
import shutil

import pytest

from porting import proof
from porting.parity import harness

GEMMA2 = "Gemma2ForCausalLM"
MISTRAL = "MistralForCausalLM"
# google/gemma-2-9b config.json's feature values (the sizes stay tiny, max_position_embeddings 256)
PUBLISHED = dict(
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    sliding_window=4096,
    query_pre_attn_scalar=256,
    hidden_activation="gelu_pytorch_tanh",
)
WINDOWED = {"sliding_window", "layer_types"}


def _gemma2(d, edit=None, **changes):
    return proof.make_hf(d, GEMMA2, edit=edit, **proof.tiny_fields(GEMMA2, **PUBLISHED, **changes))


def _without(hf_dir, d, **changes):
    """A copy of ``hf_dir`` whose config.json has ``changes`` (the same weights)."""
    shutil.copytree(hf_dir, d)
    cfg = json.loads((d / "config.json").read_text()) | changes
    (d / "config.json").write_text(json.dumps(cfg))
    return d


MAKE = {
    "published": lambda d: _gemma2(d),
    # the same model imported from a config.json without its final cap: a conversion that dropped it
    "published_nocap": lambda d: _without(
        _gemma2(d.parent / "src"), d, final_logit_softcapping=None
    ),
    "reached_nocap": lambda d: _without(
        _gemma2(d.parent / "src", edit=proof.reach_caps()), d, final_logit_softcapping=None
    ),
    "mistral_200": lambda d: proof.make_hf(
        d, MISTRAL, **proof.tiny_fields(MISTRAL, sliding_window=200)
    ),
    "mistral_4096": lambda d: proof.make_hf(
        d, MISTRAL, **proof.tiny_fields(MISTRAL, sliding_window=4096)
    ),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(name) -> (hf_dir, ckpt)``, each built and imported (gate off) once."""
    return proof.imported_variants(tmp_path_factory, lambda d, name: MAKE[name](d))


def _named(report) -> set[str]:
    return {u["field"] for u in report.unobserved}


def test_published_gemma2_features_are_named(converted):
    """At the gate's default 1e-4 the window, both caps and the GELU variant are out of reach of a
    tiny model, and the passing gate names each; the perturbation check agrees field for field."""
    hf, ckpt = converted("published")
    report = harness.verify(hf, ckpt)
    assert report.passed
    named = _named(report)
    assert named == WINDOWED | {
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "hidden_activation",
    }
    text = report.summary()
    assert text.startswith("parity PASS") and "5 mapped features the prompts could not see" in text
    assert "not seen       sliding_window=4096: the longest prompt is 133 tokens" in text
    assert "max_position_embeddings 256" in text  # why no prompt was made longer
    assert "final_logit_softcapping=30: the largest |logit| was 0.6" in text
    assert report.as_dict()["unobserved"][0]["value"] == 4096
    seen, _ = proof.prove_features_named(hf, report)
    assert set(seen.unobserved) == named  # the exact rules and the site rules, all borne out
    assert {"rope_theta", "query_pre_attn_scalar"} <= set(seen.observed)


def test_at_the_kits_tolerance_the_final_cap_is_seen(converted):
    """At 1e-5 the final cap of 30 bends logits of ~0.6 by 8.5e-5: seen, and not named (its rule
    is exact); the attention cap and the window stay named."""
    hf, ckpt = converted("published")
    seen, report = proof.prove_features_named(hf, ckpt)  # verify at 1e-5
    assert "final_logit_softcapping" in seen.observed
    assert "final_logit_softcapping" not in _named(report)
    assert WINDOWED | {"attn_logit_softcapping"} <= _named(report)
    assert set(seen.unobserved) == WINDOWED | {"attn_logit_softcapping"}


def test_tiny_caps_and_window_are_seen_by_far(tmp_path):
    """The proof kit's own Gemma 2 (caps 0.05 / 0.2, window 8): dropping any of them moves the
    gate's logits by more than 100x the tolerance. So does each published cap on a model made to
    reach it (proof.reach_caps)."""
    tiny = proof.make_hf(tmp_path / "tiny", GEMMA2, **proof.tiny_fields(GEMMA2))
    seen = proof.prove_features_observed(tiny)
    for name in WINDOWED | {"attn_logit_softcapping", "final_logit_softcapping"}:
        assert seen.observed[name] > 100 * proof.ATOL, (name, seen)
    reached = _gemma2(tmp_path / "reached", edit=proof.reach_caps())
    seen = proof.prove_features_observed(reached)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        assert seen.observed[name] > 100 * proof.ATOL, (name, seen)
    assert set(seen.unobserved) == WINDOWED  # the window of 4096 is past max_position_embeddings


def test_a_dropped_cap_fails_the_gate_only_when_in_reach(converted):
    """The negative control: checkpoints imported from the same weights with the final cap removed.
    Out of reach (published caps, tiny logits) the gate passes and names the cap; in reach
    (reach_caps) it fails by far, and names neither cap."""
    hf, ckpt = converted("published_nocap")
    report = harness.verify(hf.parent / "src", ckpt)
    assert report.passed and "final_logit_softcapping" in _named(report)
    hf, ckpt = converted("reached_nocap")
    report = harness.verify(hf.parent / "src", ckpt, atol=proof.ATOL, rtol=proof.RTOL)
    assert not report.passed and report.max_abs_diff > 100 * proof.ATOL
    assert not {"attn_logit_softcapping", "final_logit_softcapping"} & _named(report)


def test_mistral_windows(converted, tmp_path):
    """Window 8: seen by the default prompts. Window 200 (no default prompt passes it): the random
    prompt grows to 216 tokens and the window is seen. Window 4096 in a model of 256 positions:
    named, the prompts unchanged."""
    small = proof.make_hf(tmp_path / "w8", MISTRAL, **proof.tiny_fields(MISTRAL))
    assert "sliding_window" in proof.prove_features_observed(small).observed

    hf, ckpt = converted("mistral_200")
    assert [p.shape[1] for p in proof.prompts_of(ckpt)] == [3, 38, 133, 216]
    seen, report = proof.prove_features_named(hf, ckpt)
    assert report.passed and report.unobserved == [] and "sliding_window" in seen.observed

    hf, ckpt = converted("mistral_4096")
    assert max(p.shape[1] for p in proof.prompts_of(ckpt)) == 133
    seen, report = proof.prove_features_named(hf, ckpt)
    assert report.passed and _named(report) == {"sliding_window"} == set(seen.unobserved)


def _mistral_7b(**changes):
    """mistralai/Mistral-7B-v0.1's shape (config.json), as transformers reads it."""
    import transformers

    shape = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        sliding_window=4096,
    )
    return transformers.MistralConfig(**shape | changes)


def test_the_long_prompt_has_a_budget():
    """A 4096 window is passed by a 4112-token prompt in a tiny model, but not at 7B (~1e14 FLOP
    and 8 GiB of scores a layer): there the report names the window and says why."""
    tiny = _mistral_7b(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=130,
    )
    assert harness.long_prompt_len(tiny) == 4112
    assert harness.long_prompt_len(_mistral_7b()) is None
    sight = harness.Sight(_mistral_7b(), [3, 38, 133, 64], [], None, 1e-4, 1e-4)
    (named,) = harness.unobserved_features(sight, {"sliding_window"})
    assert "sliding_window=4096: the longest prompt is 133 tokens" in named["why"]
    assert "over the gate's budget" in named["why"]
    assert harness.long_prompt_len(_mistral_7b(sliding_window=None)) is None
    assert harness.long_prompt_len(_mistral_7b(sliding_window=9000)) is None  # over 8192


def test_of_two_activation_fields_only_the_one_the_reference_reads_is_named(tmp_path):
    """Gemma-7B's card says hidden_act "gelu" and hidden_activation "gelu_pytorch_tanh";
    transformers' Gemma computes the first (exact GELU). The gate judges that one and leaves the
    unread field out of its report."""
    from porting.api import import_hf

    arch = "GemmaForCausalLM"
    hf = proof.make_hf(tmp_path / "hf", arch, **proof.tiny_fields(arch))
    cfg = json.loads((hf / "config.json").read_text())
    cfg |= {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}
    (hf / "config.json").write_text(json.dumps(cfg))
    import_hf(hf, tmp_path / "nemo", verify=False, show_progress=False)
    report = harness.verify(hf, tmp_path / "nemo")
    assert report.passed
    assert [u["field"] for u in report.unobserved] == ["hidden_act"], report.unobserved
