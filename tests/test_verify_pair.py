"""`porting verify` of an HF directory and a checkpoint of another model: refused on the configs
alone, before torch, NeMo or Megatron load; a pair the gate must judge is left to the gate."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from porting.contract import registry
from porting.contract.config_map import differences, to_mcore
from porting.contract.registry import family_by_name
from porting.convert.checkpoint import open_checkpoint
from porting.errors import PortingError
from porting.parity.pair import SHAPE_FIELDS, check_pair, settled
from porting.testing import with_edited_manifest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "nemo", "megatron", "transformers", "lightning"}


def _config(hf: Path) -> dict:
    """``hf``'s config.json in the 4.x spelling the edits below use (a transformers 5 save, on the
    current stack, spells the rotary settings as rope_parameters)."""
    from porting.contract.hf_spelling import internal

    return internal(json.loads((hf / "config.json").read_text()))


def _edited(hf: Path, out: Path, **changes) -> Path:
    shutil.copytree(hf, out)
    cfg = _config(out) | changes
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _verify(hf: Path, ckpt: Path) -> tuple[int, str, set[str]]:
    """Exit code, stderr and the top-level modules loaded of ``porting verify`` in a fresh process."""
    code = (
        "import sys\nfrom porting.cli import main\ncode = main(['verify', sys.argv[1], sys.argv[2]])\n"
        "print(' '.join(sys.modules))\nsys.exit(code)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(hf), str(ckpt)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    loaded = {m.partition(".")[0] for m in proc.stdout.split()}
    return proc.returncode, proc.stderr, loaded


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"num_hidden_layers": 3}, "num_hidden_layers 2 against 3"),
        ({"hidden_size": 128, "head_dim": 32}, "hidden_size 64 against 128"),
        ({"num_key_value_heads": 4}, "num_key_value_heads 2 against 4"),
        ({"vocab_size": 131}, "vocab_size 130 against 131"),
        (
            {"architectures": ["MistralForCausalLM"]},
            "'LlamaForCausalLM' against 'MistralForCausalLM'",
        ),
    ],
    ids=["layers", "width", "kv heads", "vocabulary", "architecture"],
)
def test_a_pair_of_other_shapes_is_refused_before_any_model_library_loads(
    tiny_llama, tiny_nemo, tmp_path, changes, said
):
    hf = _edited(tiny_llama, tmp_path / "hf", **changes)
    code, err, loaded = _verify(hf, tiny_nemo)
    assert code == 2, err
    assert said in err, err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert loaded & HEAVY == set()


def test_a_pair_the_gate_must_judge_is_not_refused(tiny_llama, tiny_nemo, tmp_path):
    """A rotary base, a norm epsilon or a bookkeeping key move the logits or nothing: whether the
    checkpoint reproduces the HF model is the gate's verdict (the proof kit's negative controls
    verify such pairs), not the pair check's."""
    hf = _edited(
        tiny_llama,
        tmp_path / "hf",
        rope_theta=10000.0,
        rms_norm_eps=1e-3,
        transformers_version="0.0.1",
        torch_dtype="bfloat16",
    )
    assert check_pair(hf, open_checkpoint(tiny_nemo))["rope_theta"] == 10000.0


@pytest.mark.parametrize("relabelled", [False, True], ids=["as written", "as tsuzumi"])
def test_a_family_that_runs_one_class_for_two_architectures_pairs_either(tmp_path, relabelled):
    """tsuzumi loads LlamaForCausalLM for both its names: a checkpoint written from a Llama
    directory (tests/data/tsuzumi-0.1, by an earlier porting) pairs with it and with the same
    files labelled tsuzumi."""
    written = Path(__file__).parent / "data" / "tsuzumi-0.1"
    hf = written / "hf"
    if relabelled:
        hf = _edited(
            hf, tmp_path / "hf", architectures=["TsuzumiForCausalLM"], model_type="tsuzumi"
        )
    assert check_pair(hf, open_checkpoint(written / "nemo"))["num_hidden_layers"] == 2


def test_a_checkpoint_adopted_from_its_config_is_paired_by_the_gate(tiny_llama, tmp_path):
    """One trained elsewhere (``--hf-config``: no ``porting/`` of ours) is adopted through
    transformers and NeMo, so its pair is checked by the gate once the process is offline with
    its GPUs hidden: still before any model is built, with the same message."""
    from porting.api import import_hf
    from porting.convert.foreign import reading
    from porting.parity import harness

    ckpt = tmp_path / "megatron-lm"
    import_hf(tiny_llama, ckpt, fmt="megatron-lm", verify=False, show_progress=False)
    shutil.rmtree(ckpt / "porting")
    other = _edited(tiny_llama, tmp_path / "other", num_hidden_layers=3)
    with reading(ckpt, None, tiny_llama, None):
        with pytest.raises(PortingError, match="num_hidden_layers 2 against 3"):
            harness.verify(other, ckpt)


def test_differences_compare_what_the_fields_set(tiny_llama):
    """Through the family's config map, with what Megatron derives filled in: a config that
    spells out the head width its width and heads imply is the same model; one that changes it
    is named by its HF field."""
    llama = family_by_name("llama")
    base = _config(tiny_llama)
    base.pop("head_dim", None)
    implied = base["hidden_size"] // base["num_attention_heads"]

    def diff(other: dict) -> list[str]:
        return differences(base, other, llama.config_entries, "a", "b", SHAPE_FIELDS, settled)

    assert diff(base | {"head_dim": implied}) == []
    assert diff(base | {"head_dim": None}) == []
    assert diff(base | {"head_dim": 2 * implied}) == [
        f"head_dim absent against {2 * implied} (Megatron's kv_channels {implied} against {2 * implied})"
    ]
    assert diff(base | {"rope_theta": 1.0, "rms_norm_eps": 0.5}) == []  # not shapes
    with pytest.raises(PortingError, match=r"^b: "):
        diff(base | {"hidden_size": 0})


def _published() -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location(
        "published_configs", Path(__file__).with_name("published_configs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PUBLISHED


def _accepted(cfg: dict, entries) -> bool:
    try:
        to_mcore(cfg, entries)
    except PortingError:
        return False
    return True


def test_every_published_config_pairs_with_itself_and_its_resaved_spellings():
    """Each config as its hub repository ships it (tests/published_configs.py), every field:
    against itself, and against the same model re-saved with its head width spelled out or
    left to the default and its bookkeeping keys changed, the pair check finds nothing; one
    layer more (where the config allows it), it names num_hidden_layers."""
    checked = 0
    for hub_id, cfg in _published().items():
        try:
            family = registry.family_for_hf_config(cfg, hub_id)
        except PortingError:
            continue  # refused on import, so never a checkpoint's config
        entries = family.config_entries

        def diff(other, cfg=cfg, entries=entries, hub_id=hub_id):
            return differences(cfg, other, entries, hub_id, "re-saved", SHAPE_FIELDS, settled)

        assert diff(cfg) == [], hub_id
        resaved = cfg | {"transformers_version": "9.9.9", "_name_or_path": "elsewhere"}
        heads = cfg.get("num_attention_heads")
        if "head_dim" in cfg and heads and cfg["head_dim"] == cfg["hidden_size"] // heads:
            without = {k: v for k, v in resaved.items() if k != "head_dim"}
            if family.claims(without) and _accepted(without, entries):  # a family may require it
                resaved = without
        assert diff(resaved) == [], hub_id
        layers = "num_hidden_layers"
        more = cfg | {layers: cfg.get(layers, 0) + 1}
        if layers in cfg and _accepted(more, entries):  # not where layer_types lists each layer
            said = diff(more)
            assert said and said[0].startswith(f"{layers} {cfg[layers]} against "), (hub_id, said)
        checked += 1
    assert checked >= 25, checked


def test_a_hostile_manifest_config_is_refused_by_name(tiny_nemo, tiny_llama, tmp_path):
    """The checkpoint's recorded config is read through the same config map as any config.json:
    a crafted value is refused, naming the manifest, before any model library loads."""
    ckpt = with_edited_manifest(
        tiny_nemo, tmp_path / "ckpt", lambda d: d["hf_config"].update(num_hidden_layers="2; x")
    )
    code, err, loaded = _verify(tiny_llama, ckpt)
    assert code == 2, err
    assert "porting.json: hf_config" in err and "num_hidden_layers" in err, err
    assert loaded & HEAVY == set()
