"""Vision-language checkpoints (``Gemma3ForConditionalGeneration``,
``Mistral3ForConditionalGeneration``): the language model imports through its family with the
gate run on the container class itself, and export writes the container back bit for bit, its
vision tower and projector untouched (``Family.containers``, porting/convert/container.py).

Each container is built here with the installed transformers (4.57 on the NeMo 2 stack, 5.x on
the current one), its language model a tiny one of the family's text class.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting import proof
from porting.cli import main

CONTAINERS = {
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM", "gemma3"),
    "mistral3": ("Mistral3ForConditionalGeneration", "MistralForCausalLM", "mistral"),
}


def _make(root: Path, name: str) -> Path:
    arch, text, _ = CONTAINERS[name]
    return proof.make_container(root, arch, text, **proof.tiny_fields(text))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return proof.imported_variants(tmp_path_factory, _make)


@pytest.fixture
def said(monkeypatch) -> list[str]:
    """What the import logs, whatever an earlier case's library did to logging in this worker
    (NeMo's logging set-up disables the loggers that exist when it runs)."""
    import logging

    lines: list[str] = []
    logger = logging.getLogger("porting.convert.hf_import")
    monkeypatch.setattr(logger, "disabled", False)
    level = logger.level
    logger.setLevel(logging.INFO)
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_the_language_model_matches_the_container_class_on_text(name, imported):
    """fp32 full logits of the container class (its language model run on text) against the
    Megatron model, whole and streamed (atol=rtol=1e-5 per logit, equal top-1)."""
    hf, ckpt = imported(name)
    proof.prove_parity(hf, ckpt)


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_the_container_comes_back_bit_for_bit(name, imported, tmp_path):
    """Every tensor (the vision tower's and projector's included) byte for byte, config.json key
    for key and in order, the tokenizer, and the container class loads it."""
    hf, ckpt = imported(name)
    proof.prove_round_trip(hf, ckpt, tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    carried = [k for k in back if "vision_tower" in k or "multi_modal_projector" in k]
    assert carried and all(
        torch.equal(back[k].view(torch.uint8), t.view(torch.uint8))
        for k, t in load_file(hf / "model.safetensors").items()
        if k in carried
    )


def test_import_says_what_it_carried_and_the_gate_runs_the_container(tmp_path, said):
    hf = _make(tmp_path / "hf", "gemma3")
    code, out, err = _run(["import", str(hf), "--out", str(tmp_path / "ck"), "--json"])
    assert code == 0, err
    assert json.loads(out[out.index("{") :])["passed"]
    line = next(x for x in said if "is a Gemma3ForConditionalGeneration" in x)
    assert "its language model is converted" in line
    assert "carried as stored (multi_modal_projector, vision_tower)" in line
    manifest = json.loads((tmp_path / "ck" / "context" / "porting.json").read_text())
    assert manifest["container"]["architecture"] == "Gemma3ForConditionalGeneration"
    assert manifest["hf_config"]["architectures"] == ["Gemma3ForCausalLM"]
    assert (tmp_path / "ck" / "context" / "hf_extra" / "carried" / "model.safetensors").is_file()
    # the planner plans the container as its language model
    shape = __import__("porting.planner.model", fromlist=["x"]).load_model(hf)
    assert (shape.layers, shape.hidden) == (3, 64)


def test_a_planted_fault_is_named_by_its_layer(imported, tmp_path):
    from porting.contract.registry import family_by_name

    hf, _ = imported("mistral3")
    family = family_by_name("mistral")
    proof.prove_fault_named(hf, tmp_path / "bad", family, layer=1, num_layers=3)


def test_tensor_parallel_2_matches_tp_1(imported, tmp_path):
    proof.prove_tp2([imported(n)[1] for n in CONTAINERS], tmp_path)


def test_the_class_s_own_names_round_trip_as_they_came(tmp_path):
    """A checkpoint stored under the container class's own parameter names
    (``model.language_model.``, ``model.vision_tower.``, ``lm_head.``) rather than as published
    imports, and exports under those names."""
    hf = _make(tmp_path / "hf", "mistral3")
    tensors = load_file(hf / "model.safetensors")
    renames = {"language_model.model.": "model.language_model.",
               "language_model.lm_head.": "lm_head.", "vision_tower.": "model.vision_tower.",
               "multi_modal_projector.": "model.multi_modal_projector."}  # fmt: skip

    def own(key: str) -> str:
        return next((new + key[len(old) :] for old, new in renames.items()
                     if key.startswith(old)), key)  # fmt: skip

    save_file({own(k): v for k, v in tensors.items()}, hf / "model.safetensors", {"format": "pt"})
    code, _, err = _run(["import", str(hf), "--out", str(tmp_path / "ck")])
    assert code == 0, err
    proof.prove_round_trip(hf, tmp_path / "ck", tmp_path / "back")
    assert "model.language_model.embed_tokens.weight" in load_file(
        tmp_path / "back" / "model.safetensors"
    )


def test_the_megatron_layouts_carry_the_container(tmp_path):
    """Megatron-LM's and Megatron-Bridge's layouts keep the carried tensors with our files."""
    hf = _make(tmp_path / "hf", "gemma3")
    proof.prove_formats(hf, tmp_path / "formats")


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"text_config": None}, "needs its language model's config as an object under 'text_config'"),
        ({"text_config.model_type": "llama"}, "model_type"),
    ],
)  # fmt: skip
def test_a_container_whose_language_model_is_not_the_family_s_is_refused(change, problem, tmp_path):
    hf = _make(tmp_path / "src", "mistral3")
    cfg = json.loads((hf / "config.json").read_text())
    for key, value in change.items():
        if "." in key:
            outer, inner = key.split(".")
            cfg[outer][inner] = value
        else:
            cfg[key] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    code, _, err = _run(["import", str(hf), "--out", str(tmp_path / "ck")])
    assert code == 2 and problem in err, err
    assert not (tmp_path / "ck").exists()


def test_a_container_with_no_language_model_tensor_is_refused(tmp_path):
    hf = _make(tmp_path / "hf", "gemma3")
    tensors = load_file(hf / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "language_model" not in k},
              hf / "model.safetensors", {"format": "pt"})  # fmt: skip
    code, _, err = _run(["import", str(hf), "--out", str(tmp_path / "ck")])
    assert code == 2 and "no language-model tensor" in err, err


def test_a_manifest_naming_another_spelling_is_refused_on_export(imported, tmp_path):
    """The manifest may be hostile: a spelling is only ever one the family's container declares."""
    _, ckpt = imported("gemma3")
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    path = copy / "context" / "porting.json"
    manifest = json.loads(path.read_text())
    manifest["container"]["spelling"] = [["", "model."]]
    path.write_text(json.dumps(manifest))
    code, _, err = _run(["export", str(copy), "--out", str(tmp_path / "back")])
    assert code == 2 and "container spelling" in err, err
    assert not (tmp_path / "back").exists()


def test_a_release_s_sparse_text_config_reads_with_its_class_defaults(tmp_path):
    """transformers writes a composite config's parts as their differences from the part's class
    defaults (Gemma 3's releases keep six keys of their language model's): the keys left out
    read as the installed class's defaults, and export writes the text config back as sparse as
    it came."""
    import transformers

    hf = _make(tmp_path / "hf", "gemma3")
    cfg = json.loads((hf / "config.json").read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    text = cfg["text_config"]
    cfg["text_config"] = {
        k: v for k, v in text.items() if k == "model_type" or defaults.get(k, "<none>") != v
    }
    assert "rms_norm_eps" not in cfg["text_config"]  # left to the class, as published
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    code, _, err = _run(["import", str(hf), "--out", str(tmp_path / "ck")])
    assert code == 0, err
    proof.prove_round_trip(hf, tmp_path / "ck", tmp_path / "back")


def test_what_the_container_class_does_not_apply_is_converted_as_it_runs(tmp_path, said):
    """Gemma3ForConditionalGeneration returns its head's logits uncapped whatever the text
    config's final_logit_softcapping says (Gemma3ForCausalLM caps them): the language model is
    converted as the container runs it, the import says so, and the key goes back as it came."""
    arch, text, _ = CONTAINERS["gemma3"]
    fields = proof.tiny_fields(text, final_logit_softcapping=0.5)
    hf = proof.make_container(tmp_path / "hf", arch, text, **fields)
    code, _, err = _run(["import", str(hf), "--out", str(tmp_path / "ck")])
    assert code == 0, err
    text = " ".join(said)
    assert "final_logit_softcapping=0.5 read as null: Gemma3ForConditionalGeneration" in text
    proof.prove_round_trip(hf, tmp_path / "ck", tmp_path / "back")
    assert (
        json.loads((tmp_path / "back" / "config.json").read_text())["text_config"][
            "final_logit_softcapping"
        ]
        == 0.5
    )


# google/gemma-3-4b-it's config.json as published (transformers 4.50.0.dev0 wrote its
# text_config as its differences from Gemma3TextConfig's defaults), shrunk in size only: the
# language model to 6 layers (five local, one global) of width 64 and a 512-token vocabulary, the
# vision tower to two layers of width 32 on 28-pixel images.
GEMMA_3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 64,  # 2560
        "intermediate_size": 128,  # 10240
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,  # 34
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 8,  # 1024
        "vocab_size": 512,  # Gemma3TextConfig's 262208
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 32,  # 1152
        "image_size": 28,  # 896
        "intermediate_size": 64,  # 4304
        "model_type": "siglip_vision_model",
        "num_attention_heads": 2,  # 16
        "num_hidden_layers": 2,  # 27
        "patch_size": 14,
        "vision_use_head": False,
    },
}


# Mistral Small 3.2 24B's config.json as transformers 4.57.1 writes it (the copy of FLUX.2's text
# encoder: "dtype" keys, a full text_config), shrunk in size only: the language model to 2 layers
# of width 64 (4 heads of 16, 2 KV heads) and a 512-token vocabulary, the Pixtral tower to two
# layers of width 32 on 28-pixel images.
MISTRAL_SMALL_3_2 = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "dtype": "bfloat16",
    "image_token_index": 10,
    "model_type": "mistral3",
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "text_config": {
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "head_dim": 16,  # 128
        "hidden_act": "silu",
        "hidden_size": 64,  # 5120
        "initializer_range": 0.02,
        "intermediate_size": 128,  # 32768
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 4,  # 32
        "num_hidden_layers": 2,  # 40
        "num_key_value_heads": 2,  # 8
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "use_cache": True,
        "vocab_size": 512,  # 131072
    },
    "transformers_version": "4.57.1",
    "vision_config": {
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "head_dim": 16,  # 64
        "hidden_act": "silu",
        "hidden_size": 32,  # 1024
        "image_size": 28,  # 1540
        "initializer_range": 0.02,
        "intermediate_size": 64,  # 4096
        "model_type": "pixtral",
        "num_attention_heads": 2,  # 16
        "num_channels": 3,
        "num_hidden_layers": 2,  # 24
        "patch_size": 14,
        "rope_theta": 10000.0,
    },
    "vision_feature_layer": -1,
}


@pytest.mark.parametrize(
    "config", [GEMMA_3_4B_IT, MISTRAL_SMALL_3_2], ids=["gemma-3-4b-it", "mistral-small-3.2"]
)
def test_a_release_s_config_as_written_imports_with_the_gate_and_comes_back(config, tmp_path):
    hf = proof.make_container_as_shipped(tmp_path / "hf", config)
    code, _, err = _run(["import", str(hf), "--out", str(tmp_path / "ck")])
    assert code == 0, err
    proof.prove_round_trip(hf, tmp_path / "ck", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config


def test_carried_tensors_that_leave_the_checkpoint_are_refused_on_export(imported, tmp_path):
    """A crafted checkpoint whose carried file links outside it: export refuses it by name and
    writes nothing."""
    _, ckpt = imported("mistral3")
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    carried = copy / "context" / "hf_extra" / "carried" / "model.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(carried, outside)
    carried.symlink_to(outside)
    code, _, err = _run(["export", str(copy), "--out", str(tmp_path / "back")])
    assert code == 2 and "outside" in err and "carried" in err, err
    assert not (tmp_path / "back").exists()
