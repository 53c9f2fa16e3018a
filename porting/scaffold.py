"""``porting new-family``: a family package skeleton written from an HF model directory.

From the directory's ``config.json``, the HF model that config describes (built on the meta
device: names and shapes, no memory) and the checkpoint's tensor names (safetensors headers only;
no tensor is read, no code of the checkpoint is run) it writes an installable package started
from the closest installed family (the *base*, :func:`closest`; ``--base`` picks one):

- ``pyproject.toml`` with the ``porting.families`` entry point;
- ``<package>/model.py``: the Megatron config, a subclass of the base's NeMo-free one
  (``porting.mcore``), and ``<package>/model_nemo.py``: its NeMo config and model, subclasses of
  the base's (a base with no NeMo-free config: ``model.py`` holds both, over the base's NeMo ones);
- ``<package>/converter.py``: the base's config entries and weight table, imported and extended:
  every HF field placed as the base places it, carried, required or
  :class:`~porting.contract.config_map.Undecided` (with the Megatron-Core field it usually sets);
  the base's fields this checkpoint lacks and every HF tensor no entry of the base's table reads,
  each also ``Undecided``; the family object;
- ``tests/test_<name>.py``: builds tiny random models of the config and of a variant with its
  optional features toggled, locally, and runs the full proof (:mod:`porting.proof`).

A family with anything undecided is refused when used, with everything left listed at once, so
the author sees what is left rather than one failure at a time.

The checkpoint is untrusted, and whoever installs the package imports what was generated from it:
nothing read from the checkpoint (a field, its value, the architecture, the model type, a tensor
name) may become code. Every such value reaches the files through one writer, :func:`_literal`
(the printable-ASCII Python literal of plain data, which can close no string, comment or line),
and every generated module is parsed back and compared with the same templates rendered with a
numbered placeholder for each value: the trees must be the same but for each placeholder's place,
which must hold exactly its value. The base's module and class names come from the installed
families' entry points, not from the checkpoint, and are written only if they are dotted Python
names. The family name is checked before any path is made from it, and ``--out`` may not overlap
the input (:func:`porting.guard.refuse_overlap`).
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


# Entries the scaffold knows how to place for fields the base does not, for the values it sees.
# The value picks the entry; none of it is written into the entry's text.
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

# HF config keys and the Megatron-Core ``TransformerConfig`` fields they usually set: written beside
# each Undecided field, and the guide's table (docs/families.md, "HF config keys and Megatron-Core
# fields"; a test keeps the two the same). Checked against the families here and Megatron-Bridge's
# CONFIG_MAPPING (megatron/bridge/models/conversion/model_bridge.py).
HINTS: dict[str, str] = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "head_dim": "kv_channels",
    "vocab_size": "vocab_size (padded to make_vocab_size_divisible_by)",
    "max_position_embeddings": "seq_length",
    "initializer_range": "init_method_std",
    "rms_norm_eps": "layernorm_epsilon, with normalization='RMSNorm'",
    "layer_norm_eps": "layernorm_epsilon; a norm with a bias is normalization='LayerNorm'",
    "layer_norm_epsilon": "layernorm_epsilon; a norm with a bias is normalization='LayerNorm'",
    "norm_eps": "layernorm_epsilon",
    "rope_theta": "rotary_base",
    "partial_rotary_factor": "rotary_percent (rotates the first part of each head)",
    "rotary_pct": "rotary_percent",
    "rope_scaling": "rope_scaling / seq_len_interpolation_factor / a replaced rotary table",
    "tie_word_embeddings": "share_embeddings_and_output_weights",
    "hidden_act": "activation_func, with gated_linear_unit=True for a gated MLP (silu: SwiGLU)",
    "attention_bias": "add_qkv_bias (an o_proj bias too: add_bias_linear, which also biases the "
    "MLP)",
    "use_qkv_bias": "add_qkv_bias",
    "qkv_bias": "add_qkv_bias",
    "mlp_bias": "add_bias_linear",
    "qk_layernorm": "qk_layernorm (per head; a norm over all heads needs a custom layer)",
    "use_qk_norm": "qk_layernorm",
    "attention_dropout": "attention_dropout (0 for parity)",
    "hidden_dropout": "hidden_dropout (0 for parity)",
    "sliding_window": "window_size=(sliding_window - 1, 0)",
    "layer_types": "window_attn_skip_freq (which layers the window applies to)",
    "use_parallel_residual": "a parallel attention+MLP block: a custom layer spec",
    "query_pre_attn_scalar": "softmax_scale = query_pre_attn_scalar ** -0.5",
    "attn_logit_softcapping": "a soft-capped core attention: a custom layer spec",
    "final_logit_softcapping": "a soft-capped output layer (the model's configure_model)",
    "num_local_experts": "num_moe_experts",
    "num_experts": "num_moe_experts",
    "n_routed_experts": "num_moe_experts",
    "num_experts_per_tok": "moe_router_topk",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "n_shared_experts": "moe_shared_expert_intermediate_size = n * moe_intermediate_size",
    "norm_topk_prob": "moe_router_pre_softmax (false renormalises the top-k)",
    "router_aux_loss_coef": "moe_aux_loss_coeff",
    "scoring_func": "moe_router_score_function",
    "routed_scaling_factor": "moe_router_topk_scaling_factor",
    "n_group": "moe_router_num_groups",
    "topk_group": "moe_router_group_topk",
    "first_k_dense_replace": "moe_layer_freq (a list: 0 for each dense layer)",
    "q_lora_rank": "q_lora_rank (multi-latent attention)",
    "kv_lora_rank": "kv_lora_rank (multi-latent attention)",
    "qk_nope_head_dim": "qk_head_dim",
    "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "v_head_dim": "v_head_dim",
}

# The family name becomes a directory, the package porting_family_NAME, class names and an entry
# point; the bound keeps every file name made from it far below the file systems' 255 bytes.
NAME_MAX = 64
# CPython's parser stops at 200 nested brackets; no published config nests a field this deep.
_DEPTH_MAX = 32
# Building the HF model on the meta device costs time per module: past these, the tensor names
# come from the checkpoint alone.
_LAYERS_MAX = 1024
_EXPERTS_MAX = 1024
# The guide's sections the generated files point to (tests/test_new_family.py checks each is a
# heading of docs/families.md).
GUIDE_KEYS = "hf-config-keys-and-megatron-core-fields"
GUIDE_TABLE = "the-weight-table"
GUIDE_MEGATRON = "the-megatron-side"
GUIDE_START = "start-one-porting-new-family"


@dataclass
class Scaffold:
    """What :func:`new_family` wrote and what is left for the author."""

    root: Path
    base: str = ""
    scores: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    mapped: list[str] = field(default_factory=list)
    required: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    uncovered_tensors: list[str] = field(default_factory=list)
    conditional_tensors: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    tensors_from: str = ""
    claims: str = ""

    def summary(self) -> str:
        """Lines for the terminal: what was written, from which base and why, what is left."""

        def names(items: list[str]) -> str:
            return ", ".join(map(_shown, items)) or "none"

        def score(row: tuple[str, int, int, int, int]) -> str:
            fam, tensors, tensors_of, fields, fields_of = row
            return f"{fam} (tensors {tensors}/{tensors_of}, fields {fields}/{fields_of})"

        lines = [
            f"wrote {self.root}",
            f"  claims: {self.claims}",
            f"  started from family {self.base}: the HF tensors its table reads and the config "
            "fields it places as they are, of this checkpoint's; closest first: "
            + ", ".join(map(score, self.scores[:4])),
            f"  config fields mapped or carried: {len(self.mapped)}",
            f"  config fields required to keep their value: {names(self.required)}",
            f"  config fields still to decide: {names(self.undecided)}",
            f"  fields the base requires that this checkpoint lacks (Undecided): {names(self.missing)}",
            f"  HF tensors no entry of the base's table reads (Undecided): "
            f"{names(self.uncovered_tensors)}",
            f"  HF tensors the base's table reads only as its Megatron config says (a when): "
            f"{names(self.conditional_tensors)}",
            f"  HF tensor names from: {self.tensors_from}",
            *(f"  hint: {h}" for h in self.hints),
            f"next: decide each Undecided in converter.py (docs/families.md#{GUIDE_KEYS}), then "
            f"pip install -e {self.root} && pytest {self.root / 'tests'}",
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
    """What the files are rendered from. ``name`` (checked) and ``base`` (an installed family's
    dotted names, checked) are written as text; every other field through :class:`_Values`."""

    name: str
    base: _Base
    hf_class: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    replaced: list[str]
    entries: list[Callable[[_Values], str]]
    comments: dict[int, str]
    imports: set[str]
    missing: list[str]
    uncovered: list[str]
    tiny: dict[str, Any]
    toggled: dict[str, Any]
    summary: str


_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _ref(value: Any, what: str, family: str) -> tuple[str, str]:
    """``(module, attribute)`` of an installed family's ``"module:Name"`` (or a class), refused
    unless both are dotted Python names: they are written into the package as code."""
    if isinstance(value, type):
        module, attr = value.__module__, value.__qualname__
    else:
        module, _, attr = str(value).partition(":")
    if not (_DOTTED.fullmatch(module) and attr.isidentifier() and attr.isascii()):
        raise PortingError(
            f"family {family}'s {what} {_quoted(str(value))} is not module:Name; choose another "
            "--base"
        )
    return module, attr


@dataclass
class _Base:
    """The installed family the new one starts from."""

    family: Any
    module: str
    attr: str
    config_cls: tuple[str, str]
    model_cls: tuple[str, str]
    core_config_cls: tuple[str, str] | None


def _base(installed: Any) -> _Base:
    fam = installed.family
    module, attr = _ref(installed.value, "entry point", fam.name)
    return _Base(
        family=fam,
        module=module,
        attr=attr,
        config_cls=_ref(fam.config_cls, "config_cls", fam.name),
        model_cls=_ref(fam.model_cls, "model_cls", fam.name),
        core_config_cls=None
        if fam.core_config_cls is None
        else _ref(fam.core_config_cls, "core_config_cls", fam.name),
    )


def _pattern(key: str) -> str:
    """A tensor name as a table writes it: its first index ``*`` (the layer), the next ``#``."""
    parts = key.split(".")
    seen = 0
    for i, part in enumerate(parts):
        if part.isdigit() and part.isascii() and 0 < i < len(parts) - 1:
            parts[i] = "*" if seen == 0 else "#"
            seen += 1
    return ".".join(parts)


def _coverage(family: Any, patterns: list[str]) -> tuple[list[str], list[str], int]:
    """Of ``patterns`` (the checkpoint's HF tensors, as table patterns): those no entry of the
    family's table reads, those read only under a ``when`` (the family's Megatron config decides),
    and how many tensor patterns the table reads unconditionally that the checkpoint lacks.

    Entries sharing one ``when`` are one condition: it counts as met only if the checkpoint has
    every tensor those entries read (Llama's all-linear-biases condition reads an ``o_proj`` bias
    too, so it does not cover a checkpoint that biases q/k/v alone). A stacked tensor's ``[#]``
    slices count as the tensor."""
    import fnmatch

    from porting.contract.mapping import Ignore

    have = set(patterns)
    read, conditional, absent = set(), set(), set()
    groups: dict[int, set[str]] = {}
    ignores = []
    for e in family.weights:
        if isinstance(e, Ignore):
            ignores.append(e.hf)
            continue
        names = {re.sub(r"\[#\]\Z", "", n) for n in ((e.hf,) if isinstance(e.hf, str) else e.hf)}
        if e.when is None:
            read |= names & have
            absent |= names - have
        else:
            groups.setdefault(id(e.when), set()).update(names)
    for names in groups.values():
        if names <= have:
            read |= names
            conditional |= names
    uncovered = [
        p for p in patterns if p not in read and not any(fnmatch.fnmatchcase(p, g) for g in ignores)
    ]
    return uncovered, sorted(conditional), len(absent)


def _hf_tensor_names(hf_class: str, cfg: dict) -> tuple[list[str], str]:
    """The state-dict names of ``hf_class`` built on the meta device from ``cfg``, and where the
    names came from; ``[]`` with the reason where transformers cannot build it (or it would have
    too many modules to build quickly)."""
    import copy

    layers = cfg.get("num_hidden_layers")
    experts = [v for k, v in cfg.items() if "expert" in k and type(v) is int]
    if type(layers) is not int or not 0 < layers <= _LAYERS_MAX:
        return [], f"num_hidden_layers is not an integer from 1 to {_LAYERS_MAX}"
    if any(v > _EXPERTS_MAX for v in experts):
        return [], f"an expert count above {_EXPERTS_MAX}"
    import torch
    import transformers
    from accelerate import init_empty_weights

    cls = getattr(transformers, hf_class)
    try:
        config = cls.config_class.from_dict(copy.deepcopy(cfg))
        with init_empty_weights(include_buffers=True):
            model = cls._from_config(config, dtype=torch.float32)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    except Exception as err:  # the reference class refuses this config: the gate will say so
        return (
            [],
            f"transformers' {hf_class} cannot be built from config.json ({type(err).__name__})",
        )
    return _published_names(cfg.get("model_type"), shapes), ""


def _published_names(model_type: object, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The names of a model's tensors as its checkpoints store them: transformers 5 holds a
    mixture's experts stacked in the model and saves them one tensor each again (the names
    the families' tables read), where it knows the model type's published form."""
    from porting.convert.packed_experts import Slice, plan

    published = plan(model_type, shapes, "the model built on the meta device")
    if not published:
        return list(shapes)
    stored = {v.stored if isinstance(v, Slice) else v for v in published.values()}
    return [n for n in shapes if n not in stored] + list(published)


def _refused(entries: list, cfg: dict, where: str) -> set[str]:
    """The fields of ``cfg`` that ``entries`` (a family's config entries) or the shared rules
    refuse at the values seen, each entry asked on its own."""
    from porting.contract.config_map import (
        FIELD_RULES,
        Carry,
        Derived,
        Field,
        NoOp,
        Require,
        known_fields,
    )

    out = set()
    # A family's functions may do work per layer (a per-layer pattern list): past the bound they
    # are not run, and only the checks and requirements speak.
    layers = cfg.get("num_hidden_layers")
    run = type(layers) is int and 0 < layers <= _LAYERS_MAX
    for name, value in cfg.items():
        if name in FIELD_RULES:
            try:
                FIELD_RULES[name](name, value, where)
            except Exception:
                out.add(name)
    for e in entries:
        present = [n for n in sorted(known_fields((e,))) if n in cfg]
        if not present:
            continue
        try:
            if isinstance(e, Require):
                ok = bool(e.ok(cfg[e.hf]))
            elif isinstance(e, NoOp):
                ok = e.is_noop(cfg)
            else:
                if isinstance(e, Field | Derived | Carry) and e.check is not None:
                    for n in present:
                        e.check(n, cfg[n], where)
                if isinstance(e, Field) and run:
                    e.to_mcore(cfg[e.hf])
                elif isinstance(e, Derived) and run:
                    e.to_mcore(cfg)
                ok = True
        except Exception:
            ok = False
        if not ok:
            out.update(present)
    return out


def _score(
    family: Any, cfg: dict, patterns: list[str], where: str
) -> tuple[int, int, set[str], int]:
    """``(tensors its table reads, config fields it places as seen, fields it refuses, tensors
    its table always reads that the checkpoint lacks)``."""
    from porting.contract.config_map import known_fields

    own = {k for k in cfg if k not in _common_fields()}
    refused = _refused(list(family.config_entries), cfg, where)
    placed = own & known_fields(family.config_entries) - refused
    uncovered, _, absent = _coverage(family, patterns)
    return len(patterns) - len(uncovered), len(placed), refused, absent


def _missing(family: Any, cfg: dict) -> list[str]:
    """The fields the family's entries require (a ``Field`` with no default) that ``cfg`` lacks."""
    from porting.contract.config_map import _MISSING, Field

    return sorted(
        e.hf
        for e in family.config_entries
        if isinstance(e, Field) and e.default is _MISSING and e.hf not in cfg
    )


def closest(
    cfg: dict, patterns: list[str], arch: str, where: str = "config.json"
) -> list[tuple[Any, tuple[int, int, int, int], set[str]]]:
    """Every installed family that loads, closest to the checkpoint first, each with ``(tensors
    its table reads, of all, config fields it places as they are, of all)`` and the fields it
    refuses. Closest: the highest sum of the two fractions; then one that claims the
    architecture, then the fewest tensors and required fields it has that the checkpoint lacks,
    then by name."""
    from porting.contract import registry

    own = len([k for k in cfg if k not in _common_fields()]) or 1
    rows = []
    for inst in registry.installed():
        fam = inst.family
        if fam is None:
            continue
        tensors, fields, refused, absent = _score(fam, cfg, patterns, where)
        rank = (
            -(tensors / (len(patterns) or 1) + fields / own),
            arch not in fam.architectures,
            absent + len(_missing(fam, cfg)),
            fam.name,
        )
        rows.append((rank, inst, (tensors, len(patterns), fields, own), refused))
    rows.sort(key=lambda r: r[0])
    return [(inst, score, refused) for _, inst, score, refused in rows]


def _tiny(cfg: dict) -> tuple[dict, dict]:
    """The config's own fields at test size (the HF reference class builds it locally), and the
    fields of a second variant: the output tied the other way, the query heads grouped the other
    way."""
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
    toggled = {"num_key_value_heads": 2 if tiny["num_key_value_heads"] == 4 else 4}
    if type(cfg.get("tie_word_embeddings")) is bool:
        toggled["tie_word_embeddings"] = not cfg["tie_word_embeddings"]
    return tiny, toggled


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


def _plan(
    name: str, hf_dir: Path, hf_class: str | None, base_name: str | None, result: Scaffold
) -> _Plan:
    from porting.convert.hf_files import read_hf_config

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
    architectures, model_types = _claims(name, arch, mtype, result)
    patterns = _tensor_patterns(hf_class, cfg, hf_dir, result)
    chosen = _chosen_base(cfg, patterns, arch, config, base_name, result)
    base = _base(chosen[0])
    fam = base.family
    result.base = fam.name
    replaced = _replaced_fields(fam, cfg, chosen[2], result)
    entries, comments, imports = _entries(cfg, fam, replaced, arch, result)
    result.uncovered_tensors, result.conditional_tensors, _ = _coverage(fam, patterns)
    _hints(fam, result)
    tiny, toggled = _tiny(cfg)
    return _Plan(
        name=name,
        base=base,
        hf_class=hf_class,
        architectures=architectures,
        model_types=model_types,
        replaced=sorted(replaced),
        entries=entries,
        comments=comments,
        imports=imports,
        missing=result.missing,
        uncovered=result.uncovered_tensors,
        tiny=tiny,
        toggled=toggled,
        summary=f"started by porting new-family from a {mtype or arch} checkpoint",
    )


def _claims(name: str, arch: str, mtype, result: Scaffold) -> tuple[tuple, tuple]:
    """``(architectures, model_types)`` the new family claims: the architecture where no family
    has it, else the model type (the import then chooses the family with --family)."""
    from porting.contract import registry

    taken = {k: f.name for f in registry.families() for k in f.keys}
    if arch not in taken:
        result.claims = f"{_shown(arch)} (its architecture)"
        return (arch,), ()
    if mtype and mtype not in taken:
        # The architecture is another family's: claim the model type, chosen with --family.
        result.claims = (
            f"model_type {_quoted(mtype)}; {arch} is family {taken[arch]}'s, so import with "
            f"--family {name}"
        )
        return (), (mtype,)
    raise PortingError(
        f"{_quoted(arch)} and model_type {_quoted(str(mtype))} are both claimed (by "
        f"{taken.get(arch)}, {taken.get(mtype)}); give the checkpoint its own architecture name"
    )


def _tensor_patterns(hf_class: str, cfg: dict, hf_dir: Path, result: Scaffold) -> list[str]:
    """The table patterns of every tensor the HF class has for this config and every one the
    checkpoint holds (which the import must account for too)."""
    from porting.convert.safetensors_io import SafetensorsSource

    names, why = _hf_tensor_names(hf_class, cfg)
    source = SafetensorsSource(hf_dir, allow_pickle=False)
    try:
        stored = list(source.keys())
    finally:
        source.close()
    result.tensors_from = (
        f"the {hf_class} model built on the meta device from config.json, and the checkpoint"
        if names
        else f"the checkpoint alone ({why})"
    )
    patterns = sorted({_pattern(k) for k in [*names, *stored]})

    return patterns


def _chosen_base(cfg: dict, patterns: list[str], arch: str, config: Path, base_name, result):
    """The family to start from: ``--base``, else the closest (:func:`closest`), with every
    family's score."""
    ranked = closest(cfg, patterns, arch, str(config))
    result.scores = [(i.name, *score) for i, score, _ in ranked]
    if base_name is None:
        if not ranked:
            raise PortingError("no installed family loads: there is none to start from")
        chosen = ranked[0]
    else:
        found = [r for r in ranked if r[0].name == base_name]
        if not found:
            raise PortingError(
                f"--base {_quoted(base_name)}: no installed family of that name loads (installed: "
                f"{', '.join(r[0].name for r in ranked)})"
            )
        chosen = found[0]
        result.scores.sort(key=lambda row: row[0] != base_name)
    return chosen


def _replaced_fields(fam, cfg: dict, refused, result: Scaffold) -> set[str]:
    """The fields whose base entries are left out and placed afresh: those the base refuses at
    this checkpoint's values, those it requires that the checkpoint lacks, and the other fields
    of any entry so left out."""
    from porting.contract.config_map import known_fields

    result.missing = _missing(fam, cfg)
    replaced = set(refused) | set(result.missing)
    while True:
        grown = {
            n
            for e in fam.config_entries
            if known_fields((e,)) & replaced
            for n in known_fields((e,))
        }
        if grown <= replaced:
            break
        replaced |= grown
    return replaced


def _entries(cfg: dict, fam, replaced: set[str], arch: str, result: Scaffold):
    """Each config field placed: as the base places it, by the engine's common rule, as a known
    field's entry, ``Require`` for the model type, else ``Undecided`` with the Megatron-Core field
    it usually sets; ``(entries, comments, imports)``."""
    from porting.contract.config_map import known_fields, native_architecture

    base_fields = known_fields(fam.config_entries) - replaced
    # the engine refuses auto_map on an architecture transformers lacks: the author decides it
    remote = not native_architecture(arch)
    entries: list[Callable[[_Values], str]] = []
    # the Megatron-Core field an Undecided entry's HF field usually sets (HINTS: our text only)
    comments: dict[int, str] = {}
    imports: set[str] = set()
    for key in sorted(cfg):
        value = cfg[key]
        decide = key == "auto_map" and remote
        if not decide and key in base_fields:
            result.mapped.append(key)
            continue
        if not decide and key in _common_fields() and key not in _KNOWN.keys() | replaced:
            result.mapped.append(key)  # the engine's rule for every family (config_map.COMMON)
            continue
        known = _KNOWN[key](value) if key in _KNOWN and not decide else None
        if key == "model_type":
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
            hint = HINTS.get(key)
            entries.append(lambda lit, k=key, v=value: f"Undecided({lit(k)}, {lit(v)})")
            comments[len(entries) - 1] = "" if hint is None else f"  # Megatron-Core: {hint}"
            imports.add("Undecided")
            result.undecided.append(key)
    return entries, comments, imports


def _hints(fam, result: Scaffold) -> None:
    """What the author is told besides the lists: norm biases, the base's fields it lacks."""
    norm_bias = [p for p in result.uncovered_tensors if re.search(r"norm[^.]*\.bias\Z", p)]
    if norm_bias:
        result.hints.append(
            f"{len(norm_bias)} norm bias tensor(s) ({_shown(norm_bias[0])}, ...): a LayerNorm "
            "with a bias is Megatron-Core's normalization='LayerNorm' (set it in model.py's "
            "config; its tables name the bias ...layernorm.bias)"
        )
    for key in result.missing:
        result.hints.append(
            f"{key}: the base {fam.name} requires it and this checkpoint has none; the Megatron "
            f"field it sets is {HINTS.get(key, 'in the base family converter')} "
            f"(docs/families.md#{GUIDE_KEYS})"
        )


def new_family(
    name: str,
    hf_dir: str | Path,
    out: str | Path,
    overwrite: bool = False,
    hf_class: str | None = None,
    base: str | None = None,
) -> Scaffold:
    """Write the package skeleton for family ``name`` started from ``hf_dir`` at ``out``.

    ``hf_class``: the ``transformers`` class for the HF reference side, where the checkpoint's
    architecture is not one (an ``auto_map`` checkpoint whose own code we never run).
    ``base``: the installed family to start from; by default the closest (:func:`closest`).
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
    plan = _plan(name, hf_dir, hf_class, base, result)
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
    pkg = f"porting_family_{plan.name}"
    cls = "".join(part.capitalize() for part in plan.name.split("_"))
    files = {
        "pyproject.toml": _pyproject(plan.name, pkg),
        f"{pkg}/__init__.py": f'"""The {plan.name} family for porting."""\n',
    }
    models, classes = _model_files(plan, pkg, cls)
    files |= models
    files[f"{pkg}/converter.py"] = _converter(plan, lit, classes)
    files[f"tests/test_{plan.name}.py"] = _test_file(plan, lit)
    return files


def _pyproject(name: str, pkg: str) -> str:
    """The package's pyproject.toml: its ``porting.families`` entry point."""
    return f"""[build-system]
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


def _model_files(plan: _Plan, pkg: str, cls: str) -> tuple[dict[str, str], tuple]:
    """``model.py`` (and ``model_nemo.py`` where the base has a NeMo-free config) started from the
    base's classes, and the family's (config, model, core config) class references."""
    name = plan.name
    files = {}
    (cmod, ccls), (mmod, mcls) = plan.base.config_cls, plan.base.model_cls
    base_name = plan.base.family.name
    guide = f"""Set the Megatron-Core fields that differ here (docs/families.md#{GUIDE_KEYS}: a LayerNorm with a
bias is ``normalization = "LayerNorm"``), or give ``transformer_layer_spec`` a spec of your own
where the maths differs (docs/families.md#{GUIDE_MEGATRON})."""
    model_class = f'''class {cls}Model(BaseModel):
    """NeMo 2.0 model of the {name} family; its own class, so NeMo finds its connectors."""

    def __init__(self, config=None, optim=None, tokenizer=None, model_transform=None):
        super().__init__(
            config or {cls}Config(), optim=optim, tokenizer=tokenizer, model_transform=model_transform
        )
'''
    if plan.base.core_config_cls is None:
        classes = (f"{pkg}.model:{cls}Config", f"{pkg}.model:{cls}Model", None)
        files[
            f"{pkg}/model.py"
        ] = f'''"""The {name} decoder as a NeMo 2.0 model: the {base_name} family's, to start from.
{guide}"""

from __future__ import annotations

from dataclasses import dataclass

from {cmod} import {ccls} as BaseConfig
from {mmod} import {mcls} as BaseModel


@dataclass
class {cls}Config(BaseConfig):
    """Megatron GPT config of the {name} family."""


{model_class}'''
    else:
        kmod, kcls = plan.base.core_config_cls
        classes = (
            f"{pkg}.model_nemo:{cls}Config",
            f"{pkg}.model_nemo:{cls}Model",
            f"{pkg}.model:{cls}Core",
        )
        files[
            f"{pkg}/model.py"
        ] = f'''"""The {name} decoder's Megatron-Core config: the {base_name} family's, to start from.
{guide}
No NeMo here (porting.mcore): ``porting verify`` builds the model from this class alone; its
NeMo classes, in ``model_nemo.py``, inherit every field and method."""

from __future__ import annotations

from dataclasses import dataclass

from {kmod} import {kcls} as BaseCore


@dataclass
class {cls}Core(BaseCore):
    """Megatron GPT config of the {name} family."""
'''
        files[
            f"{pkg}/model_nemo.py"
        ] = f'''"""The {name} family's NeMo 2.0 classes: the config of ``model.py`` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its model, made as every family's are
(porting.nemo_classes)."""

from __future__ import annotations

from {cmod} import {ccls} as BaseConfig
from {pkg}.model import {cls}Core
from porting.nemo_classes import nemo_classes

{cls}Config, {cls}Model = nemo_classes({cls}Core, BaseConfig, __name__)
'''
    return files, classes


def _converter(plan: _Plan, lit: _Values, classes: tuple) -> str:
    """``converter.py``: the base's entries and table, extended by the plan's, and the family."""
    name = plan.name
    bmod, base_name = plan.base.module, plan.base.family.name
    config_lines = "\n".join(
        f"    {entry(lit)},{plan.comments.get(i, '')}" for i, entry in enumerate(plan.entries)
    )
    ours = ", ".join(n for n in ("HEAD_DIM_OR_NULL", "ROPE_SCALING") if n in plan.imports)
    kinds = ", ".join(k for k in ("Require", "Undecided") if k in plan.imports | {"Undecided"})
    imports = (
        f"from {bmod} import {plan.base.attr} as BASE\n"
        + (f"from converters.llama import {ours}\n" if ours else "")
        + f"from porting.contract.config_map import {kinds}, known_fields\n"
        + "from porting.contract.family import Family\n"
    )

    def names(items: list[str]) -> str:
        return "".join(f"    {lit(n)},\n" for n in items)

    return f'''"""The {name} family: config entries, weight table, family object (its Megatron side, in
``model.py``, is named and loaded when a conversion needs them).

Written by ``porting new-family`` from an HF checkpoint, started from the {base_name} family, the
closest installed one: its entries and table, imported and extended. Every config field is placed:
as the base places it, ``Require`` for values kept as seen, ``Undecided`` for what is left to
decide; each HF tensor no entry of the base's table reads is ``Undecided`` too. The family is
refused, everything left listed at once, until nothing is undecided. The Megatron-Core field each
HF key usually sets: docs/families.md#{GUIDE_KEYS}.
"""

from __future__ import annotations

{imports}
# Fields the base's entries place differently from this checkpoint (they refuse its value, it
# lacks one they require, or they share an entry with such a field): the base's entries for
# them are left out, and each is placed below.
REPLACED = (
{names(plan.replaced)})

# Fields the base requires that this checkpoint lacks: decide what sets their Megatron fields in
# this family (map another field of this checkpoint onto it, or set it in model.py's config),
# then delete the name here.
MISSING = (
{names(plan.missing)})

# The HF tensors of this checkpoint's HF class and files that no entry of the base's table reads
# (as table patterns: * the layer, # the expert). Give each an entry in WEIGHTS (Rename, Fused) or
# an Ignore with its reason, then delete it here (docs/families.md#{GUIDE_TABLE}).
TENSORS_TO_DECIDE = (
{names(plan.uncovered)})

CONFIG = (
    *(e for e in BASE.config_entries if not known_fields((e,)) & set(REPLACED)),
{config_lines}
    *(Undecided(f, "absent from the checkpoint; the base family requires it") for f in MISSING),
    *(Undecided(t, "an HF tensor no entry of WEIGHTS reads") for t in TENSORS_TO_DECIDE),
)

WEIGHTS = (*BASE.weights,)

FAMILY = Family(
    name={name!r},
    architectures={lit(plan.architectures)},
    model_types={lit(plan.model_types)},
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls={lit(classes[0])},
    model_cls={lit(classes[1])},
    core_config_cls={lit(classes[2])},
    shape_context=BASE.shape_context,
    context_symbols=BASE.context_symbols,
    hf_model_class={lit(plan.hf_class)},
    summary={lit(plan.summary)},
)
'''


def _test_file(plan: _Plan, lit: _Values) -> str:
    """``tests/test_NAME.py``: the full proof on tiny models of the config and of a variant."""
    name = plan.name
    tiny = "".join(f"    {lit(k)}: {lit(v)},\n" for k, v in sorted(plan.tiny.items()))
    toggled = "".join(f"    {lit(k)}: {lit(v)},\n" for k, v in sorted(plan.toggled.items()))
    return f'''"""The full proof of the {name} family (porting.proof) on tiny random models of its config,
built here (no hub): fp32 full-logit parity (atol=rtol=1e-5, 100% top-1), the streamed gate,
tensor parallel 2, an exact round trip, a planted fault named by layer; and parity and the round
trip again on a second variant with the config's optional features toggled. Add the published
configs your family converts as further variants (docs/families.md#{GUIDE_START})."""

from __future__ import annotations

import pytest

from porting import proof
from porting.api import import_hf
from porting.contract import registry

ARCHITECTURE = {lit(plan.hf_class)}
TINY = {{
{tiny}}}
# The same config with its optional features the other way: the output tied or not, the query
# heads grouped differently.
TOGGLED = {{
    **TINY,
{toggled}}}


def _converted(root, fields):
    hf = proof.make_hf(root / "hf", ARCHITECTURE, **fields)
    import_hf(hf, root / "nemo", verify=False, show_progress=False, family={name!r})
    return hf, root / "nemo"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return _converted(tmp_path_factory.mktemp("{name}"), TINY)


@pytest.fixture(scope="module")
def toggled(tmp_path_factory):
    return _converted(tmp_path_factory.mktemp("{name}_toggled"), TOGGLED)


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


def test_toggled_variant_parity(toggled):
    proof.prove_parity(*toggled)


def test_toggled_variant_round_trip_is_exact(toggled, tmp_path):
    proof.prove_round_trip(*toggled, tmp_path / "hf-back")
'''
