"""Each family's NeMo-free Megatron config (``Family.core_config_cls``, porting.mcore) builds the
model its NeMo config builds, and verification runs without loading NeMo.

For every architecture of every installed family with a core config, the tiny config of the proof
kit goes through the family's config map into both classes; the two Megatron-Core models must have
the same modules (type and name), the same parameters and buffers (name and shape) and, with one's
state loaded into the other, bit-identical logits. A checkpoint written before the NeMo classes
moved (its ``io.json`` names ``models.llama.LlamaConfig``) still passes the io.json check, and
`porting verify` of a tiny checkpoint leaves no NeMo, Lightning module in the process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from porting import proof
from porting.commands.demo import compare_hf_dirs
from porting.contract import registry
from porting.convert.megatron import build_config, build_mcore_model, init_parallel
from porting.testing import foreign_lines

CASES = [
    (family.name, arch)
    for family in registry.families()
    if family.core_config_cls is not None
    for arch in family.architectures
    if arch not in ("TsuzumiForCausalLM",)  # no transformers class: llama's, under its name
]
HEAVY = ("nemo", "lightning", "pytorch_lightning")


def _hf_config(arch: str) -> dict:
    import transformers

    fields = proof.tiny_fields(arch)
    config = getattr(transformers, arch).config_class(**fields).to_dict()
    return config | {"architectures": [arch]}


def _modules(model: torch.nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__qualname__) for name, m in model.named_modules()]


def _tensors(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items() if v is not None]


def test_every_family_with_a_core_config_is_covered():
    assert {name for name, _ in CASES} >= {
        "llama", "mistral", "qwen", "moe", "olmoe", "gpt-oss", "deepseek", "olmo2", "phi3",
        "gemma", "gemma3", "falcon", "nemotron", "granite", "smollm3", "granitemoe", "deepseek-v2",
        "llama4",
    }  # fmt: skip
    assert registry.family_by_name("tsuzumi").core_config_cls == "models.llama:LlamaCore"


@pytest.mark.parametrize(("name", "arch"), CASES, ids=[a for _, a in CASES])
def test_core_and_nemo_configs_build_the_same_model(name, arch):
    family = registry.family_by_name(name)
    hf_config = _hf_config(arch)
    init_parallel()
    built = {}
    for nemo in (False, True):
        config, _ = build_config(family, hf_config, torch.float32, 1, nemo=nemo)
        assert (type(config) is family.config_class()) == nemo, type(config)
        torch.manual_seed(0)
        built[nemo] = build_mcore_model(config)
    core, nemo = built[False], built[True]
    assert isinstance(core.config, family.config_class(nemo=False))
    assert not isinstance(core.config, family.config_class())
    assert _modules(core) == _modules(nemo)
    assert _tensors(core) == _tensors(nemo)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in nemo.parameters():
            p.normal_(0, 0.05)
    core.load_state_dict(nemo.state_dict())
    ids = torch.randint(
        0, hf_config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2)
    )
    positions = torch.arange(12).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        a, b = core(ids, positions, None), nemo(ids, positions, None)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), (a - b).abs().max()


def _run_fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_conversions_load_no_nemo(tiny_llama, tiny_nemo, tmp_path):
    """`porting verify` of a checkpoint written now and of one written before the NeMo classes
    moved (its io.json naming them in models.llama), `porting export` of the first, `porting
    import` (NeMo 2's files written as data) and `porting convert` of its output: all pass, and
    none loads NeMo or Lightning, or prints a line not ours."""
    old = tmp_path / "old"
    shutil.copytree(tiny_nemo, old)
    io_json = old / "context" / "io.json"
    text = io_json.read_text()
    assert '"models.llama_nemo"' in text
    io_json.write_text(text.replace('"models.llama_nemo"', '"models.llama"'))
    assert '"models.llama_nemo"' not in io_json.read_text()
    json.loads(io_json.read_text())
    result = _run_fresh(
        f"""
        import sys
        from porting.cli import main
        for ckpt in ({str(tiny_nemo)!r}, {str(old)!r}):
            assert main(["verify", {str(tiny_llama)!r}, ckpt]) == 0
        assert main(["export", {str(tiny_nemo)!r}, "--out", {str(tmp_path / "hf")!r}]) == 0
        assert main(["import", {str(tiny_llama)!r}, "--out", {str(tmp_path / "nemo")!r}]) == 0
        mlm = {str(tmp_path / "mlm")!r}
        assert main(["convert", {str(tmp_path / "nemo")!r}, "--to", "megatron-lm", "--out", mlm]) == 0
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print("HEAVY", loaded)
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("parity PASS") == 6, result.stdout
    assert "HEAVY []" in result.stdout, result.stdout
    assert foreign_lines(result.stderr) == [], result.stderr  # the imports' summaries only
    assert compare_hf_dirs(tiny_llama, tmp_path / "hf").exact


def test_old_class_names_are_the_nemo_classes():
    """What an old checkpoint's io.json names resolves to the class NeMo loads it with."""
    import models.llama
    import models.llama_nemo

    assert models.llama.LlamaConfig is models.llama_nemo.LlamaConfig
    assert models.llama.LlamaModel is models.llama_nemo.LlamaModel
    with pytest.raises(AttributeError, match="'models.llama' has no attribute 'Nope'"):
        _ = models.llama.Nope


def test_gpt_core_defaults_every_field_as_nemos_gpt_config():
    """XCore comes first in XConfig(XCore, GPTConfig)'s MRO, so each field NeMo's GPTConfig
    re-defaults must be declared by GPTCore with NeMo's default, or the NeMo class loses it."""
    import dataclasses

    from nemo.collections.llm.gpt.model.base import GPTConfig

    from porting.mcore import GPTCore

    def default(cls, name):
        f = cls.__dataclass_fields__[name]
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    nemo_only = {"transformer_layer_spec", "forward_step_fn", "data_step_fn", "generation_config"}
    nemo_only |= {
        "use_transformer_engine_full_layer_spec",
        "tp_comm_overlap_cfg",
        "tp_only_amax_red",
    }
    declared = set(vars(GPTConfig)["__annotations__"]) - nemo_only
    assert "gradient_accumulation_fusion" in declared  # NeMo's default follows Apex: not a constant
    for name in sorted(declared):
        assert name in vars(GPTCore)["__annotations__"], f"{name}: NeMo's GPTConfig declares it"
        assert default(GPTCore, name) == default(GPTConfig, name), name


def test_a_config_cls_not_built_on_the_core_config_is_refused():
    """A family made from another with its config_cls replaced but not its core_config_cls
    would verify another model than it imports."""
    import dataclasses

    from converters import llama
    from porting.errors import PortingError

    odd = dataclasses.replace(
        llama.FAMILY, name="odd", config_cls="models.falcon_nemo:FalconConfig"
    )
    with pytest.raises(PortingError, match="FalconConfig is not built on its core_config_cls"):
        build_config(odd, _hf_config("LlamaForCausalLM"), torch.float32, 1, nemo=True)


def _value(v):
    """A field's value as comparable data: functions by name (each config makes its own
    init_method partial)."""
    import functools

    if isinstance(v, functools.partial):
        return ("partial", _value(v.func), tuple(map(_value, v.args)), sorted(v.keywords.items()))
    if callable(v) and hasattr(v, "__qualname__"):
        return (getattr(v, "__module__", None), v.__qualname__)
    return v


def test_every_published_config_makes_the_same_core_and_nemo_config():
    """Each config as its hub repository ships it (tests/published_configs.py), through the family's
    config map into both classes (bf16, Megatron's padding): every field the two share holds the
    same value, so the model the core config builds at that size is the one NeMo's builds."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from porting.errors import PortingError

    spec = importlib.util.spec_from_file_location(
        "published_configs", Path(__file__).with_name("published_configs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checked = 0
    for hub_id, cfg in module.PUBLISHED.items():
        try:
            family = registry.family_for_hf_config(cfg, hub_id)
            core, _ = build_config(family, cfg, torch.bfloat16, 128, nemo=False)
        except PortingError:
            continue  # refused on import, so never a checkpoint's config
        nemo, _ = build_config(family, cfg, torch.bfloat16, 128, nemo=True)
        assert isinstance(nemo, type(core)), hub_id
        for f in dataclasses.fields(core):
            a, b = getattr(core, f.name), getattr(nemo, f.name)
            assert _value(a) == _value(b), (hub_id, f.name, a, b)
        checked += 1
    assert checked >= 25, checked
