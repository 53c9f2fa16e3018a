"""Fields at their no-op value are carried; the same field at any other value is refused by name.

Each rule names the value that makes its field a no-op (``config_map.NoOp``); each test here flips
that value and sees the refusal, so loosening the lint for published configs lets no real change
through. The published configs themselves are imported end to end in ``test_published.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from porting import proof
from porting.contract import config_map, registry
from porting.errors import PortingError

_spec = importlib.util.spec_from_file_location(
    "published_configs", Path(__file__).with_name("published_configs.py")
)
published = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(published)


def _lint(cfg: dict) -> None:
    config_map.to_mcore(cfg, registry.family_for_config(cfg).config_entries)


def _card(hub_id: str, **changes) -> dict:
    return published.PUBLISHED[hub_id] | changes


# (hub id whose card has the field, field, its no-op value, a value that changes the maths)
NOOPS = [
    ("Qwen/Qwen2.5-7B", "use_mrope", False, True),
    ("HuggingFaceTB/SmolLM2-135M", "rope_interleaved", False, True),
    ("google/gemma-7b", "rope_scaling", None, {"type": "linear", "factor": 2.0}),
    ("google/gemma-2-9b", "sliding_window_size", 4096, 2048),
    ("meta-llama/Llama-2-7b-hf", "is_encoder_decoder", False, True),
    ("meta-llama/Llama-2-7b-hf", "add_cross_attention", False, True),
    ("meta-llama/Llama-2-7b-hf", "tie_encoder_decoder", False, True),
    ("meta-llama/Llama-2-7b-hf", "cross_attention_hidden_size", None, 64),
    ("meta-llama/Llama-2-7b-hf", "pruned_heads", {}, {"0": [1]}),
    ("Qwen/Qwen3-30B-A3B", "use_mrope", False, True),
    # what transformers 5 adds to a saved config (porting.contract.hf_spelling has the rest)
    ("openai/gpt-oss-20b", "swiglu_alpha", 1.702, 1.5),
    ("google/gemma-2-2b", "use_bidirectional_attention", None, True),
]


@pytest.mark.parametrize(("hub_id", "field", "noop", "real"), NOOPS, ids=lambda v: str(v)[:40])
def test_noop_value_is_carried_and_any_other_refused_by_name(hub_id, field, noop, real):
    _lint(_card(hub_id, **{field: noop}))
    with pytest.raises(PortingError) as err:
        _lint(_card(hub_id, **{field: real}))
    said = str(err.value)
    assert f"{field}=" in said and "is not supported" in said and "changes nothing" in said, said


@pytest.mark.parametrize("value", [0, "false", None])
def test_noop_values_compare_as_json_kinds(value):
    """``use_mrope: 0`` is not ``false``: a no-op value matches in kind as well as in value."""
    with pytest.raises(PortingError, match="use_mrope"):
        _lint(_card("Qwen/Qwen2.5-7B", use_mrope=value))


@pytest.mark.parametrize(
    "field",
    ["_name_or_path", "transformers_version", "max_length", "temperature", "top_p", "do_sample",
     "id2label", "tokenizer_class", "_commit_hash"],
)  # fmt: skip
def test_bookkeeping_of_pretrained_config_is_carried_in_every_family(field):
    value = {"id2label": {"0": "LABEL_0"}, "max_length": 20, "temperature": 0.7}.get(field, "x")
    for hub_id in ("meta-llama/Llama-2-7b-hf", "tiiuae/falcon-180B", "google/gemma-2-2b",
                   "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-8B"):  # fmt: skip
        _lint(_card(hub_id, **{field: value}))


def test_is_llama_config_is_a_flag():
    _lint(_card("HuggingFaceTB/SmolLM2-135M", is_llama_config=False))
    with pytest.raises(PortingError, match="is_llama_config"):
        _lint(_card("HuggingFaceTB/SmolLM2-135M", is_llama_config="yes"))


def test_auto_map_on_a_native_architecture_is_carried_with_one_line():
    cfg = published.PUBLISHED["tiiuae/falcon-40b"]
    entries = registry.family_for_config(cfg).config_entries
    config_map.to_mcore(cfg, entries)
    lines = config_map.notes(cfg, entries)
    assert len(lines) == 1 and "auto_map" in lines[0] and "never runs or copies" in lines[0]
    assert "FalconForCausalLM" in lines[0]


def test_auto_map_where_the_code_is_the_only_definition_is_refused():
    cfg = _card("tiiuae/falcon-7b", architectures=["RWForCausalLM"])
    entries = registry.family_by_name("falcon").config_entries
    with pytest.raises(PortingError) as err:
        config_map.to_mcore(cfg, entries)
    assert "'RWForCausalLM' is no transformers class" in str(err.value)
    assert "porting new-family" in str(err.value)
    with pytest.raises(PortingError, match="auto_map"):
        config_map.to_mcore(_card("tiiuae/falcon-7b", auto_map=["x"]), entries)


def test_gemma_activation_fields_that_disagree_follow_the_reference_class_and_say_so():
    cfg = published.PUBLISHED["google/gemma-7b"]
    assert (cfg["hidden_act"], cfg["hidden_activation"]) == ("gelu", "gelu_pytorch_tanh")
    entries = registry.family_for_config(cfg).config_entries
    kwargs = config_map.to_mcore(cfg, entries)
    from models.gemma import gelu_erf

    # transformers 4.57's GemmaMLP reads hidden_act; the family names the function, the engine loads it
    assert kwargs["activation_func"].load() is gelu_erf
    (line,) = config_map.notes(cfg, entries)
    assert (
        "hidden_act='gelu'" in line and "hidden_activation='gelu_pytorch_tanh' is carried" in line
    )
    assert config_map.notes(published.PUBLISHED["google/gemma-2b"], entries) == []


def test_an_unknown_field_is_still_refused():
    with pytest.raises(PortingError, match="unsupported field.*sparsity_config"):
        _lint(_card("meta-llama/Llama-2-7b-hf", sparsity_config={"format": "2:4"}))
    # a quantization_config is read (porting.convert.quant), but only a method we read
    with pytest.raises(PortingError, match="quant_method='gptq' is not read"):
        _lint(_card("meta-llama/Llama-2-7b-hf", quantization_config={"quant_method": "gptq"}))


def test_cli_refuses_a_flipped_noop_with_nothing_written(tmp_path):
    hf = proof.make_hf(tmp_path / "hf", "Qwen2ForCausalLM", **proof.tiny_fields("Qwen2ForCausalLM"))
    for i, change in enumerate(
        [{"use_mrope": True}, {"rope_interleaved": True}, {"is_encoder_decoder": True}]
    ):
        said = proof.refused_import(hf, change, tmp_path / f"w{i}")
        (field,) = change
        assert f"{field}=true is not supported" in said, said


def test_unknown_architecture_lists_families_and_how_to_bring_one():
    with pytest.raises(PortingError) as err:
        registry.family_for_config({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    said = str(err.value)
    for fam in registry.families():
        assert f"{fam.name} (" in said
    assert "falcon (FalconForCausalLM)" in said
    assert "porting new-family" in said and "docs/families.md" in said


def test_what_other_writers_add_without_changing_the_maths_is_carried():
    """transformers.js's block for the model's web export (``transformers.js_config``: the
    kv-cache dtypes of its ONNX files), as the web-ready cards carry it: no forward pass here
    reads it, so the config imports, and export writes it back as it came."""
    web = {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}}
    card = _card("HuggingFaceTB/SmolLM2-135M", **{"transformers.js_config": web})
    _lint(card)
    entries = registry.family_for_config(card).config_entries
    mcore = SimpleNamespace(**config_map.to_mcore(card, entries))
    assert config_map.to_hf(mcore, card, entries)["transformers.js_config"] == web


def _class_defaults() -> list[tuple[str, str, str, object, object]]:
    """``(family, architecture, field, ours, the class's)`` for every field a family's config map
    defaults where a config.json leaves it out, beside the installed transformers config class's
    default (built with no arguments; ``head_dim``'s null means derived, as transformers derives
    it)."""
    import transformers

    from porting.contract.config_map import _MISSING, Field

    out = []
    for family in registry.families():
        for arch in family.architectures:
            cls = getattr(transformers, family.hf_model_class or arch)
            theirs = cls.config_class()
            for e in family.config_entries:
                if not isinstance(e, Field) or e.default is _MISSING or e.hf == "head_dim":
                    continue
                # transformers 5 folds rope_theta into rope_parameters; 4.57 keeps it an attribute
                if hasattr(theirs, e.hf) and getattr(theirs, e.hf) is not None or e.default:
                    out.append(
                        (family.name, arch, e.hf, e.default, getattr(theirs, e.hf, e.default))
                    )
    return out


def test_a_field_left_out_of_config_json_gets_the_config_classs_default():
    """transformers reads a field a config.json leaves out as its config class's default, and
    ``save_pretrained`` leaves out the ones equal to ``PretrainedConfig``'s (SmolLM3's tied
    output), so each family's default must be its classes' (Mixtral's rope_theta is 1e6, SmolLM3's
    2e6; Mistral's window 4096)."""
    differ = [c for c in _class_defaults() if c[3] != c[4]]
    assert not differ, differ
    assert len(_class_defaults()) > 50


@pytest.mark.parametrize(
    "hub_id,base",
    [("mistralai/Mixtral-8x7B-v0.1", 1e6), ("Qwen/Qwen1.5-MoE-A2.7B", 1e4)],
)
def test_a_rope_theta_left_out_is_the_mixture_classs_own(hub_id, base):
    """The moe family's classes differ: MixtralConfig's rope_theta is 1e6, Qwen2-MoE's 1e4."""
    cfg = {k: v for k, v in published.PUBLISHED[hub_id].items() if k != "rope_theta"}
    family = registry.family_for_config(cfg)
    assert config_map.to_mcore(cfg, family.config_entries)["rotary_base"] == base
