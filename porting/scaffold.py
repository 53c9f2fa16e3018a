"""``porting new-family``: a family package skeleton written from an HF model directory.

From the directory's ``config.json`` and its tensor names (safetensors headers only; no tensor is
read, no code of the checkpoint is run) it writes an installable package:

- ``pyproject.toml`` with the ``porting.families`` entry point;
- ``<package>/model.py``: the Megatron config and NeMo model (the Llama layout's, to start from);
- ``<package>/converter.py``: the config entries, every HF field placed as mapped, carried,
  required or :class:`~porting.convert.config_map.Undecided`; the weight table (the Llama layout's
  entries, the tensor names it does not cover listed); the family object and NeMo connectors;
- ``tests/test_<name>.py``: builds a tiny random model of the same config locally and runs the
  full proof (:mod:`porting.proof`).

A family with undecided fields or unmapped tensors is refused when used, with everything left
listed at once, so the author sees what is left rather than one failure at a time.
"""

from __future__ import annotations

import keyword
import pprint
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from porting.errors import PortingError

# Fields the Llama layout places (converters.tsuzumi.LLAMA_LAYOUT) and the entries for the rest
# that the scaffold knows how to place for the values it sees.
_LLAMA_LAYOUT = {
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "max_position_embeddings",
    "initializer_range",
    "attention_dropout",
    "hidden_act",
    "architectures",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
}
_KNOWN = {
    "head_dim": lambda v: "HEAD_DIM_OR_NULL",
    "rope_scaling": lambda v: "ROPE_SCALING",
    "pretraining_tp": lambda v: (
        'Require("pretraining_tp", lambda v: v == 1, "sliced-matmul emulation is not modelled")'
        if v == 1
        else None
    ),
    "attention_bias": lambda v: (
        'Require("attention_bias", lambda v: v is False, "linear biases are not modelled yet")'
        if v is False
        else None
    ),
    "mlp_bias": lambda v: (
        'Require("mlp_bias", lambda v: v is False, "linear biases are not modelled yet")'
        if v is False
        else None
    ),
    "sliding_window": lambda v: (
        'Require("sliding_window", lambda v: v is None, '
        '"sliding-window attention is not modelled yet")'
        if v is None
        else None
    ),
}


@dataclass
class Scaffold:
    """What :func:`new_family` wrote and what is left for the author."""

    root: Path
    mapped: list[str] = field(default_factory=list)
    required: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)
    uncovered_tensors: list[str] = field(default_factory=list)
    claims: str = ""

    def summary(self) -> str:
        """Lines for the terminal: what was written, what is left."""
        lines = [
            f"wrote {self.root}",
            f"  claims: {self.claims}",
            f"  config fields mapped or carried: {len(self.mapped)}",
            f"  config fields required to keep their value: {', '.join(self.required) or 'none'}",
            f"  config fields still to decide: {', '.join(self.undecided) or 'none'}",
            "  tensor names the Llama table does not cover: "
            + (", ".join(self.uncovered_tensors) or "none"),
            f"next: pip install -e {self.root} && pytest {self.root / 'tests'}",
        ]
        return "\n".join(lines)


def _identifier(name: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise PortingError(
            f"family name {name!r} must be lower case letters, digits and underscores, starting "
            "with a letter (it names the package and the entry point)"
        )
    return name


def _patterns(keys) -> list[str]:
    out = set()
    for k in keys:
        k = re.sub(r"\.layers\.\d+\.", ".layers.*.", k)
        out.add(re.sub(r"\.experts\.\d+\.", ".experts.#.", k))
    return sorted(out)


def _llama_hf_names() -> set[str]:
    from converters.tsuzumi import WEIGHTS

    names = set()
    for e in WEIGHTS:
        names.update((e.hf,) if isinstance(e.hf, str) else e.hf)
    return names


def _tiny(cfg: dict) -> dict:
    """The config's own fields at test size (the HF reference class builds it locally)."""
    heads = cfg.get("num_attention_heads") or 4
    kv = cfg.get("num_key_value_heads") or heads
    tiny = {
        k: v
        for k, v in cfg.items()
        if k not in ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype")
        and not k.endswith("_token_id")
    }
    tiny.update(
        vocab_size=130,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4 if kv == heads else (1 if kv == 1 else 2),
        max_position_embeddings=256,
    )
    if cfg.get("head_dim") is not None:
        tiny["head_dim"] = 16 if cfg["head_dim"] * heads == cfg.get("hidden_size") else 32
    if "layer_types" in tiny and isinstance(tiny["layer_types"], list):
        tiny["layer_types"] = (tiny["layer_types"] * 3)[:3]
    return tiny


def new_family(
    name: str,
    hf_dir: str | Path,
    out: str | Path,
    overwrite: bool = False,
    hf_class: str | None = None,
) -> Scaffold:
    """Write the package skeleton for family ``name`` started from ``hf_dir`` at ``out``.

    ``hf_class``: the ``transformers`` class for the HF reference side, where the checkpoint's
    architecture is not one (an ``auto_map`` checkpoint whose own code we never run).
    """
    from porting import registry
    from porting.convert.config_map import read_hf_config
    from porting.convert.safetensors_io import SafetensorsSource

    name = _identifier(name)
    out = Path(out)
    if out.exists() and not overwrite:
        raise PortingError(f"{out} exists; pass --overwrite to replace it")
    cfg = read_hf_config(hf_dir)
    arch, mtype = cfg["architectures"][0], cfg.get("model_type")
    import transformers

    hf_class = hf_class or arch
    if not isinstance(getattr(transformers, hf_class, None), type):
        raise PortingError(
            f"transformers has no class {hf_class!r} for {Path(hf_dir) / 'config.json'}'s "
            f"architecture {arch!r}; the HF reference side of a family is a transformers class: "
            "pass --hf-class with one that computes what the checkpoint's own code does"
        )
    for fam in registry.families():
        if fam.name == name:
            raise PortingError(f"a family called {name!r} is already installed ({fam.source})")
    taken = {k: f.name for f in registry.families() for k in f.keys}
    if arch not in taken:
        architectures, model_types = (arch,), ()
        claims = f"{arch} (its architecture)"
    elif mtype and mtype not in taken:
        # The architecture is another family's: claim the model type, chosen with --family.
        architectures, model_types = (), (mtype,)
        claims = (
            f"model_type {mtype!r}; {arch} is family {taken[arch]}'s, so import with "
            f"--family {name}"
        )
    else:
        raise PortingError(
            f"{arch} and model_type {mtype!r} are both claimed (by {taken.get(arch)}, "
            f"{taken.get(mtype)}); give the checkpoint its own architecture name"
        )
    result = Scaffold(out, claims=claims)
    entries = ["*LLAMA_LAYOUT"]
    for key in sorted(cfg):
        value = cfg[key]
        if key in _LLAMA_LAYOUT:
            result.mapped.append(key)
        elif key == "model_type":
            entries.append(f'Require("model_type", lambda v: v == {value!r}, "the {mtype} layout")')
            result.required.append(key)
        elif key in _KNOWN and _KNOWN[key](value) is not None:
            entries.append(_KNOWN[key](value))
            (result.required if entries[-1].startswith("Require") else result.mapped).append(key)
        else:
            entries.append(f"Undecided({key!r}, {value!r})")
            result.undecided.append(key)
    source = SafetensorsSource(hf_dir, allow_pickle=False)
    covered = _llama_hf_names()
    result.uncovered_tensors = [p for p in _patterns(source.keys()) if p not in covered]
    source.close()
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent if out.parent.exists() else None)
    )
    try:
        _write(tmp, name, hf_class, architectures, model_types, entries, result, _tiny(cfg), mtype)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _write(root, name, hf_class, architectures, model_types, entries, result, tiny, mtype) -> None:
    pkg = f"porting_family_{name}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    (root / pkg).mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text(
        f"""[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "porting-family-{name.replace("_", "-")}"
version = "0.1.0"
description = "The {name} model family for porting (HF <-> NeMo 2.0 / Megatron-Core)"
requires-python = ">=3.11"
dependencies = ["porting"]

[project.entry-points."porting.families"]
{name} = "{pkg}.converter:FAMILY"

[tool.setuptools]
packages = ["{pkg}"]
"""
    )
    (root / pkg / "__init__.py").write_text(f'"""The {name} family for porting."""\n')
    (root / pkg / "model.py").write_text(
        f'''"""The {name} decoder as a NeMo 2.0 model: the Llama layout on the stock GPT spec, to start
from. Change the config's fields here, or give ``transformer_layer_spec`` a spec of your own
where the maths differs (docs/families.md: "A family with a custom layer")."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.tsuzumi import TsuzumiConfig


@dataclass
class {cls}Config(TsuzumiConfig):
    """Megatron GPT config of the {name} family."""


class {cls}Model(GPTModel):
    """NeMo 2.0 model of the {name} family; its own class, so NeMo finds its connectors."""

    def __init__(self, config=None, optim=None, tokenizer=None, model_transform=None):
        super().__init__(
            config or {cls}Config(), optim=optim, tokenizer=tokenizer, model_transform=model_transform
        )
'''
    )
    config_lines = "\n".join(f"    {e}," for e in entries)
    body = "\n".join(entries)
    ours = ", ".join(n for n in ("HEAD_DIM_OR_NULL", "LLAMA_LAYOUT", "ROPE_SCALING") if n in body)
    kinds = ", ".join(k for k in ("Require", "Undecided") if f"{k}(" in body)
    imports = (
        f"from converters.tsuzumi import {ours}, shape_context\n"
        "from converters.tsuzumi import WEIGHTS as LLAMA_WEIGHTS\n"
        + (f"from porting.convert.config_map import {kinds}\n" if kinds else "")
        + "from porting.convert.connectors import register_connectors\n"
        "from porting.family import Family\n"
        f"from {pkg}.model import {cls}Config, {cls}Model\n"
    )
    uncovered = "".join(f"#   {p}\n" for p in result.uncovered_tensors) or "#   none\n"
    (root / pkg / "converter.py").write_text(
        f'''"""{name} <-> HF ``{hf_class}``: config entries, weight table, family, NeMo connectors.

Written by ``porting new-family`` from a {mtype} checkpoint. Every config field is placed: the
Llama layout's, ``Require`` for values kept as seen, ``Undecided`` for what is left to decide (the
family is refused, all of them listed, until none is left). See docs/families.md.
"""

from __future__ import annotations

{imports}
CONFIG = (
{config_lines}
)

# The Llama layout's table. Tensor names of the checkpoint it does not cover (the table check
# names each one, with its shape, until an entry reads it or Ignores it):
{uncovered}WEIGHTS = LLAMA_WEIGHTS

FAMILY = Family(
    name={name!r},
    architectures={architectures!r},
    model_types={model_types!r},
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls={cls}Config,
    model_cls={cls}Model,
    shape_context=shape_context,
    hf_model_class={hf_class!r},
    summary="started by porting new-family from a {mtype} checkpoint",
)


HF{cls}Importer, HF{cls}Exporter = register_connectors(FAMILY)
'''
    )
    (root / "tests" / f"test_{name}.py").write_text(
        f'''"""The full proof of the {name} family (porting.proof) on a tiny random model of its config,
built here (no hub): fp32 full-logit parity (atol=rtol=1e-5, 100% top-1), the streamed gate,
tensor parallel 2, an exact round trip, and a planted fault named by layer."""

from __future__ import annotations

import pytest

from porting import proof, registry
from porting.convert.api import import_hf

ARCHITECTURE = {hf_class!r}
TINY = {pprint.pformat(tiny, sort_dicts=True)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("{name}")
    hf = proof.make_hf(root / "hf", ARCHITECTURE, **TINY)
    import_hf(hf, root / "nemo", verify=False, show_progress=False, family={name!r})
    return hf, root / "nemo"


def test_the_family_is_installed():
    assert registry.family_by_name({name!r}).name == {name!r}


def test_parity(converted):
    proof.prove_parity(*converted)


def test_tensor_parallel_2_matches_tp_1(converted, tmp_path):
    proof.prove_tp2([converted[1]], tmp_path)


def test_round_trip_is_exact(converted, tmp_path):
    proof.prove_round_trip(*converted, tmp_path / "hf-back")


def test_every_layout_round_trips_exactly(converted, tmp_path):
    proof.prove_formats(converted[0], tmp_path)


def test_planted_fault_is_named(converted, tmp_path):
    family = registry.family_by_name({name!r})
    proof.prove_fault_named(converted[0], tmp_path / "ck", family, 1, TINY["num_hidden_layers"])
'''
    )
