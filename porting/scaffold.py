"""``porting new-family``: a family package skeleton written from an HF model directory.

From the directory's ``config.json`` and its tensor names (safetensors headers only; no tensor is
read, no code of the checkpoint is run) it writes an installable package:

- ``pyproject.toml`` with the ``porting.families`` entry point;
- ``<package>/model.py``: the Megatron config and NeMo model (the Llama layout's, to start from);
- ``<package>/converter.py``: the config entries, every HF field placed as mapped, carried,
  required or :class:`~porting.contract.config_map.Undecided`; the weight table (the Llama layout's
  entries, the tensor names it does not cover listed); the family object and NeMo connectors;
- ``tests/test_<name>.py``: builds a tiny random model of the same config locally and runs the
  full proof (:mod:`porting.proof`).

A family with undecided fields or unmapped tensors is refused when used, with everything left
listed at once, so the author sees what is left rather than one failure at a time.

The checkpoint is untrusted, and whoever installs the package imports what was generated from it:
nothing read from the checkpoint (a field, its value, the architecture, the model type, a tensor
name) may become code. Every such value reaches the files through one writer, :func:`_literal`
(the printable-ASCII Python literal of plain data, which can close no string, comment or line),
and every generated module is parsed back and compared with the same templates rendered with a
numbered placeholder for each value: the trees must be the same but for each placeholder's place,
which must hold exactly its value. The family name is checked before any path is made from it,
and ``--out`` may not overlap the input (:func:`porting.guard.refuse_overlap`).
"""

from __future__ import annotations

import ast
import errno
import importlib.util
import keyword
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from porting.errors import PortingError
from porting.guard import refuse_overlap


def _common_fields() -> set[str]:
    from porting.contract.config_map import COMMON, known_fields

    return known_fields(COMMON)


# Fields the Llama layout places (converters.llama.LLAMA_LAYOUT) and the entries for the rest
# that the scaffold knows how to place for the values it sees. The value picks the entry; none of
# it is written into the entry's text.
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

# The family name becomes a directory, the package porting_family_NAME, class names and an entry
# point; the bound keeps every file name made from it far below the file systems' 255 bytes.
NAME_MAX = 64
# CPython's parser stops at 200 nested brackets; no published config nests a field this deep.
_DEPTH_MAX = 32


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

        def names(items: list[str]) -> str:
            return ", ".join(map(_shown, items)) or "none"

        lines = [
            f"wrote {self.root}",
            f"  claims: {self.claims}",
            f"  config fields mapped or carried: {len(self.mapped)}",
            f"  config fields required to keep their value: {names(self.required)}",
            f"  config fields still to decide: {names(self.undecided)}",
            f"  tensor names the Llama table does not cover: {names(self.uncovered_tensors)}",
            f"next: pip install -e {self.root} && pytest {self.root / 'tests'}",
        ]
        return "\n".join(lines)


def _quoted(text: str) -> str:
    """``text`` for a message: quoted, escaped to printable ASCII and cut, so it stays one line."""
    return ascii(text[:80]) + (f"... ({len(text)} characters)" if len(text) > 80 else "")


def _shown(text: str) -> str:
    """``text`` as it is where it is short and printable (no terminal control), else quoted."""
    return text if len(text) <= 80 and text.isprintable() else _quoted(text)


def check_name(name: str) -> str:
    """Return ``name`` if it can name a family package, else raise :class:`PortingError`.

    Called before any path is made from it. Only its form is checked here; :func:`new_family`
    also refuses a name that an installed family or an importable package already has.
    """
    if len(name) > NAME_MAX:
        raise PortingError(
            f"family name {_quoted(name)} is {len(name)} characters long; at most {NAME_MAX}"
        )
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise PortingError(
            f"family name {_quoted(name)} must be lower case letters, digits and underscores, "
            "starting with a letter, and not a Python keyword (it names the package and the "
            "entry point)"
        )
    return name


def _refuse_taken(name: str) -> None:
    from porting.contract import registry

    for fam in registry.families():
        if fam.name == name:
            raise PortingError(f"a family called {name!r} is already installed ({fam.source})")
    package = f"porting_family_{name}"
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken package of that name is there all the same
        found = True
    if found:
        raise PortingError(
            f"a package called {package} is already importable here; the new family's package "
            "would shadow it or be shadowed by it: choose another name"
        )


def _literal(value: Any, depth: int = 0) -> str:
    """The Python literal of ``value``, plain data only (None, bool, int, float, str, list,
    tuple, dict), in printable ASCII: ``ascii()`` escapes quotes, backslashes, newlines, ``\\r``,
    U+2028, U+0085, NUL and every other character that could end a string, comment or line.

    Raises ``ValueError`` naming what has no literal: NaN, other types, nesting deeper than the
    parser takes. An infinity is written ``1e999``, which reads back as one with no name lookup.
    """
    if depth > _DEPTH_MAX:
        raise ValueError(f"nested deeper than {_DEPTH_MAX} levels")
    kind = type(value)
    # Exact types: a subclass could override __repr__.
    if value is None or kind in (bool, int, str):
        return ascii(value)
    if kind is float:
        if math.isnan(value):
            raise ValueError("NaN has no Python literal (and equals nothing, itself included)")
        if math.isinf(value):
            return "1e999" if value > 0 else "-1e999"
        return repr(value)
    if kind in (list, tuple):
        items = [_literal(v, depth + 1) for v in value]
        if kind is list:
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if kind is dict:
        pairs = (f"{_literal(k, depth + 1)}: {_literal(v, depth + 1)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    raise ValueError(f"a {kind.__name__} is not plain data")


class _Values:
    """The one way a value read from the input enters a generated file: as its :func:`_literal`,
    or (``placeholders``) as a numbered placeholder that :func:`_check_generated` matches against
    that literal."""

    def __init__(self, placeholders: bool) -> None:
        self.placeholders = placeholders
        self.seen: list[Any] = []

    def __call__(self, value: Any) -> str:
        self.seen.append(value)
        if self.placeholders:
            return repr(f"__value_{len(self.seen) - 1}__")
        return _literal(value)


_PLACEHOLDER = re.compile(r"__value_(\d+)__")


def _same_tree(got: Any, want: Any, values: list[Any]) -> bool:
    """Whether ``got`` (parsed from the real render) is ``want`` (parsed from the placeholder
    render) with each placeholder replaced by exactly its value."""
    if isinstance(want, ast.Constant) and isinstance(want.value, str):
        slot = _PLACEHOLDER.fullmatch(want.value)
        if slot:
            try:
                return _literal(ast.literal_eval(got)) == _literal(values[int(slot[1])])
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return False
    if type(got) is not type(want):
        return False
    if isinstance(want, ast.AST):
        return all(_same_tree(getattr(got, f), getattr(want, f), values) for f in want._fields)
    if isinstance(want, list):
        return len(got) == len(want) and all(
            _same_tree(g, w, values) for g, w in zip(got, want, strict=True)
        )
    return got == want


def _check_generated(files: dict[str, str], template: dict[str, str], values: list[Any]) -> None:
    """Refuse unless every generated file is its template with only the values filled in."""
    for rel, text in files.items():
        if rel.endswith(".py"):
            try:
                same = _same_tree(ast.parse(text), ast.parse(template[rel]), values)
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                same = False
        else:
            same = text == template[rel]
        if not same:
            raise PortingError(
                f"the generated {rel} is not its template with the checkpoint's values as data "
                "(the scaffold's literal writer let a value through; please report it); nothing "
                "was written"
            )


@dataclass
class _Plan:
    """What the files are rendered from. Only ``name`` (checked) is written as text; every other
    field is written through :class:`_Values`."""

    name: str
    hf_class: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    entries: list[Callable[[_Values], str]]
    imports: set[str]
    uncovered: list[str]
    tiny: dict[str, Any]
    summary: str


def _patterns(keys) -> list[str]:
    out = set()
    for k in keys:
        k = re.sub(r"\.layers\.\d+\.", ".layers.*.", k)
        out.add(re.sub(r"\.experts\.\d+\.", ".experts.#.", k))
    return sorted(out)


def _llama_hf_names() -> set[str]:
    from converters.llama import WEIGHTS

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
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        # Only integers multiply: a string times a huge head count would fill the memory.
        whole = type(head_dim) is int and type(heads) is int
        tiny["head_dim"] = 16 if whole and head_dim * heads == cfg.get("hidden_size") else 32
    if "layer_types" in tiny and isinstance(tiny["layer_types"], list):
        tiny["layer_types"] = (tiny["layer_types"] * 3)[:3]
    return tiny


def _hf_model_class(hf_class: str, arch: str, config: Path) -> str:
    import transformers

    found = None
    if hf_class.isidentifier() and not hf_class.startswith("_"):
        try:
            found = getattr(transformers, hf_class, None)
        except Exception:  # a class whose module fails to import is as good as none
            found = None
    if not (isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)):
        raise PortingError(
            f"transformers has no model class {_quoted(hf_class)} for {config}'s architecture "
            f"{_quoted(arch)}; the HF reference side of a family is a transformers class: pass "
            "--hf-class with one that computes what the checkpoint's own code does"
        )
    return hf_class


def _plan(name: str, hf_dir: Path, hf_class: str | None, result: Scaffold) -> _Plan:
    from porting.contract import registry
    from porting.convert.hf_files import read_hf_config
    from porting.convert.safetensors_io import SafetensorsSource

    config = hf_dir / "config.json"
    cfg = read_hf_config(hf_dir)
    for key, value in cfg.items():
        try:
            _literal(value)
        except ValueError as err:
            raise PortingError(f"{config}: field {_quoted(key)}: {err}") from None
    arch, mtype = cfg["architectures"][0], cfg.get("model_type")
    if mtype is not None and not isinstance(mtype, str):
        raise PortingError(f"{config}: model_type must be a string, not {_literal(mtype)[:80]}")
    hf_class = _hf_model_class(arch if hf_class is None else hf_class, arch, config)
    taken = {k: f.name for f in registry.families() for k in f.keys}
    if arch not in taken:
        architectures, model_types = (arch,), ()
        result.claims = f"{_shown(arch)} (its architecture)"
    elif mtype and mtype not in taken:
        # The architecture is another family's: claim the model type, chosen with --family.
        architectures, model_types = (), (mtype,)
        result.claims = (
            f"model_type {_quoted(mtype)}; {arch} is family {taken[arch]}'s, so import with "
            f"--family {name}"
        )
    else:
        raise PortingError(
            f"{_quoted(arch)} and model_type {_quoted(str(mtype))} are both claimed (by "
            f"{taken.get(arch)}, {taken.get(mtype)}); give the checkpoint its own architecture name"
        )
    from porting.contract.config_map import native_architecture

    # the engine refuses auto_map on an architecture transformers lacks: the author decides it
    remote = not native_architecture(arch)
    entries: list[Callable[[_Values], str]] = [lambda lit: "*LLAMA_LAYOUT"]
    imports = {"LLAMA_LAYOUT"}
    for key in sorted(cfg):
        value = cfg[key]
        known = _KNOWN[key](value) if key in _KNOWN else None
        if key in _LLAMA_LAYOUT:
            result.mapped.append(key)
        elif key in _common_fields() and key not in _KNOWN and not (key == "auto_map" and remote):
            result.mapped.append(key)  # the engine's rule for every family (config_map.COMMON)
        elif key == "model_type":
            entries.append(
                lambda lit, v=value: (
                    f"Require('model_type', lambda v: v == {lit(v)}, {lit(f'the {v} layout')})"
                )
            )
            imports.add("Require")
            result.required.append(key)
        elif known is not None:
            entries.append(lambda lit, code=known: code)
            imports.update(n for n in ("HEAD_DIM_OR_NULL", "ROPE_SCALING", "Require") if n in known)
            (result.required if known.startswith("Require") else result.mapped).append(key)
        else:
            entries.append(lambda lit, k=key, v=value: f"Undecided({lit(k)}, {lit(v)})")
            imports.add("Undecided")
            result.undecided.append(key)
    source = SafetensorsSource(hf_dir, allow_pickle=False)
    try:
        covered = _llama_hf_names()
        result.uncovered_tensors = [p for p in _patterns(source.keys()) if p not in covered]
    finally:
        source.close()
    return _Plan(
        name=name,
        hf_class=hf_class,
        architectures=architectures,
        model_types=model_types,
        entries=entries,
        imports=imports,
        uncovered=result.uncovered_tensors,
        tiny=_tiny(cfg),
        summary=f"started by porting new-family from a {mtype or arch} checkpoint",
    )


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
    from porting.convert.checkpoint import claimed_output

    name = check_name(name)
    out, hf_dir = Path(out), Path(hf_dir)
    refuse_overlap(out, [("HF directory", hf_dir)])
    try:
        # Replacing moves the old output aside and removes it: a link would be followed or left
        # behind, a file left behind.
        if out.is_symlink() or (out.exists() and not out.is_dir()):
            raise PortingError(
                f"--out {out}: a file or a symbolic link, not a directory; give another --out "
                "(nothing was written)"
            )
        if out.exists() and not overwrite:
            raise PortingError(f"{out} exists; pass --overwrite to replace it")
    except OSError as err:  # a name too long, a loop of links
        raise PortingError(f"cannot write {out}: {err.strerror or err}; nothing written") from err
    _refuse_taken(name)
    result = Scaffold(out)
    plan = _plan(name, hf_dir, hf_class, result)
    placeholders = _Values(placeholders=True)
    files = _render(plan, _Values(placeholders=False))
    _check_generated(files, _render(plan, placeholders), placeholders.seen)
    try:
        with claimed_output(out, overwrite, "family package") as tmp:
            for rel, text in files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_text(text, encoding="utf-8")
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):  # the CLI has its own line for a full disk
            raise
        raise PortingError(f"cannot write {out}: {err.strerror or err}; nothing written") from err
    return result


def _render(plan: _Plan, lit: _Values) -> dict[str, str]:
    """The package's files by relative path; every value of the plan but ``name`` through
    ``lit``, never into a comment's or a docstring's text."""
    name = plan.name
    pkg = f"porting_family_{name}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    files = {}
    files["pyproject.toml"] = f"""[build-system]
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
    files[f"{pkg}/__init__.py"] = f'"""The {name} family for porting."""\n'
    files[
        f"{pkg}/model.py"
    ] = f'''"""The {name} decoder as a NeMo 2.0 model: the Llama layout on the stock GPT spec, to start
from. Change the config's fields here, or give ``transformer_layer_spec`` a spec of your own
where the maths differs (docs/families.md: "A family with a custom layer")."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.llama import LlamaConfig


@dataclass
class {cls}Config(LlamaConfig):
    """Megatron GPT config of the {name} family."""


class {cls}Model(GPTModel):
    """NeMo 2.0 model of the {name} family; its own class, so NeMo finds its connectors."""

    def __init__(self, config=None, optim=None, tokenizer=None, model_transform=None):
        super().__init__(
            config or {cls}Config(), optim=optim, tokenizer=tokenizer, model_transform=model_transform
        )
'''
    config_lines = "\n".join(f"    {entry(lit)}," for entry in plan.entries)
    ours = ", ".join(
        n for n in ("HEAD_DIM_OR_NULL", "LLAMA_LAYOUT", "ROPE_SCALING") if n in plan.imports
    )
    kinds = ", ".join(k for k in ("Require", "Undecided") if k in plan.imports)
    imports = (
        f"from converters.llama import {ours}, shape_context\n"
        "from converters.llama import WEIGHTS as LLAMA_WEIGHTS\n"
        + (f"from porting.contract.config_map import {kinds}\n" if kinds else "")
        + "from porting.contract.family import Family\n"
    )
    # Each name as its literal, which holds no line break, so it cannot end the comment.
    uncovered = "".join(f"#   {lit(p)}\n" for p in plan.uncovered) or "#   none\n"
    files[
        f"{pkg}/converter.py"
    ] = f'''"""The {name} family: config entries, weight table, family object (its Megatron side, in
``model.py``, is named and loaded when a conversion needs it).

Written by ``porting new-family`` from an HF checkpoint. Every config field is placed: the Llama
layout's, ``Require`` for values kept as seen, ``Undecided`` for what is left to decide (the
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
    architectures={lit(plan.architectures)},
    model_types={lit(plan.model_types)},
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="{pkg}.model:{cls}Config",
    model_cls="{pkg}.model:{cls}Model",
    shape_context=shape_context,
    hf_model_class={lit(plan.hf_class)},
    summary={lit(plan.summary)},
)
'''
    tiny = "".join(f"    {lit(k)}: {lit(v)},\n" for k, v in sorted(plan.tiny.items()))
    files[
        f"tests/test_{name}.py"
    ] = f'''"""The full proof of the {name} family (porting.proof) on a tiny random model of its config,
built here (no hub): fp32 full-logit parity (atol=rtol=1e-5, 100% top-1), the streamed gate,
tensor parallel 2, an exact round trip, and a planted fault named by layer."""

from __future__ import annotations

import pytest

from porting import proof
from porting.api import import_hf
from porting.contract import registry

ARCHITECTURE = {lit(plan.hf_class)}
TINY = {{
{tiny}}}


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
    return files
