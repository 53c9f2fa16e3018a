"""Experts as transformers 5 stores them with ``save_pretrained(save_original_format=False)``: one
tensor per layer, read as the per-expert tensors of the checkpoint's original format.

transformers 5 computes a mixture-of-experts layer from two stacked tensors, ``mlp.experts.
gate_up_proj`` ``(experts, 2 * ffn, hidden)`` (each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` ``(experts, hidden, ffn)``, and by default saves them back under the
names the model was published with (``save_original_format=True``); asked not to, it writes the
stacks. The families read the published names, so a stacked checkpoint is presented as the
original: expert ``e``'s gate is ``gate_up_proj[e, :ffn]``, its up ``gate_up_proj[e, ffn:]``, its
down ``down_proj[e]`` (checked against transformers 5.12's own conversion in
``tests/test_hf_v5.py``). Mixtral's published names also keep the layer's ``block_sparse_moe``
module, which transformers 5 renamed ``mlp``.

gpt-oss is not here: its published format is already the stacked one, which its family reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from porting.errors import PortingError

# model_type -> (the published names of expert e's gate, up and down weights, under the layer's
# prefix; the published name of a module transformers 5 renamed, by its 5.x name)
_PUBLISHED = {
    "mixtral": (
        ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
         "block_sparse_moe.experts.{e}.w2.weight"),
        {"mlp.gate.weight": "block_sparse_moe.gate.weight"},
    ),
    **{
        model_type: (
            ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
             "mlp.experts.{e}.down_proj.weight"),
            {},
        )
        # kimi_k2: DeepseekV3ForCausalLM under its own model_type, for which transformers 5 has
        # no conversion back and always saves the stacks
        for model_type in ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2")
    },
}  # fmt: skip


def renamed_in_5x(model_type: object) -> dict[str, str]:
    """``{published name: transformers 5's name}`` of the weights transformers 5 moved to a module
    of another name (Mixtral's ``block_sparse_moe``), under a layer's prefix."""
    if not isinstance(model_type, str) or model_type not in _PUBLISHED:
        return {}
    return {old: new for new, old in _PUBLISHED[model_type][1].items()}


# the most experts a layer may stack (the planner's and the config rules' bound)
MAX_EXPERTS = 1 << 16
_STACK = re.compile(
    r"^(?P<layer>.*\.layers\.\d+\.)mlp\.experts\.(?P<which>gate_up_proj|down_proj)$"
)


@dataclass(frozen=True)
class Slice:
    """A published tensor inside a stored one: ``stored[expert, rows]`` (``rows`` None: all)."""

    stored: str
    expert: int
    rows: tuple[int, int] | None = None


def plan(model_type: object, shapes: dict[str, tuple[int, ...]], where: str) -> dict[str, object]:
    """``{published name: Slice or the stored name it was renamed to}`` for a checkpoint whose
    stored tensors have ``shapes``; empty where no expert stack is stored (or the model type
    keeps its stacks, as gpt-oss does). Refused naming the tensor: a stack without its twin, or
    stacks whose shapes disagree."""
    stacks = {k: m for k in shapes if (m := _STACK.match(k))}
    if not stacks or not isinstance(model_type, str) or model_type not in _PUBLISHED:
        return {}
    names, renamed = _PUBLISHED[model_type]
    out: dict[str, object] = {}
    layers = {m["layer"] for m in stacks.values()}
    for layer in sorted(layers):
        gate_up, down = f"{layer}mlp.experts.gate_up_proj", f"{layer}mlp.experts.down_proj"
        for key in (gate_up, down):
            if key not in shapes:
                raise PortingError(f"{where}: {key} is missing beside its layer's other stack")
        if len(shapes[gate_up]) != 3 or len(shapes[down]) != 3:
            raise PortingError(
                f"{where}: {gate_up} {shapes[gate_up]} and {down} {shapes[down]} must each have "
                "three dimensions (experts first)"
            )
        (e, two_ffn, hidden), (e2, hidden2, ffn) = shapes[gate_up], shapes[down]
        # a header may declare empty stacks of any length: the count is bounded before a name is
        # made for each expert
        if not (0 < e <= MAX_EXPERTS and ffn > 0 and hidden > 0):
            raise PortingError(
                f"{where}: {gate_up} {shapes[gate_up]}: a stack of 1 to {MAX_EXPERTS} experts "
                "of non-empty tensors is expected"
            )
        if (e2, hidden2, 2 * ffn) != (e, hidden, two_ffn):
            raise PortingError(
                f"{where}: {gate_up} {shapes[gate_up]} and {down} {shapes[down]} are not one "
                "layer's experts ((E, 2F, H) and (E, H, F))"
            )
        for expert in range(e):
            gate, up, dn = (layer + n.format(e=expert) for n in names)
            out[gate] = Slice(gate_up, expert, (0, ffn))
            out[up] = Slice(gate_up, expert, (ffn, 2 * ffn))
            out[dn] = Slice(down, expert)
    for new, old in renamed.items():
        for layer in sorted(layers):
            if layer + new in shapes:
                out[layer + old] = layer + new
    return out


def published_shapes(
    model_type: object, shapes: dict[str, tuple[int, ...]], where: str
) -> dict[str, tuple[int, ...]]:
    """``shapes`` with every expert stack replaced by the published per-expert tensors it holds
    (and a renamed module by its published name): what a transformers 5 model's own state dict
    looks like to a family's weight table, which names the published format."""
    published = plan(model_type, shapes, where)
    if not published:
        return shapes
    stored = {s.stored if isinstance(s, Slice) else s for s in published.values()}
    out = {k: v for k, v in shapes.items() if k not in stored}
    for name, src in published.items():
        if isinstance(src, Slice):
            shape = shapes[src.stored][1:]
            if src.rows is not None:
                shape = (src.rows[1] - src.rows[0], *shape[1:])
            out[name] = tuple(shape)
        else:
            out[name] = shapes[src]
    return out


def published_parts(
    model_type: object, key: str, shape: tuple[int, ...]
) -> list[tuple[str, Slice | None]] | None:
    """What a transformers 5 model's tensor ``key`` (of ``shape``) is made of in a checkpoint saved
    with its published names: ``[(published name, where it goes in key)]`` (None: all of it, a
    renamed module), the inverse of :func:`plan`; None where ``key`` is not a stack or a renamed
    module of ``model_type``."""
    if not isinstance(model_type, str) or model_type not in _PUBLISHED:
        return None
    names, renamed = _PUBLISHED[model_type]
    for new, old in renamed.items():
        if key.endswith("." + new):
            return [(key.removesuffix(new) + old, None)]
    m = _STACK.match(key)
    if m is None or len(shape) != 3 or not 0 < shape[0] <= MAX_EXPERTS:
        return None
    layer, gate_up = m["layer"], m["which"] == "gate_up_proj"
    gate, up, down = names
    if not gate_up:
        return [(layer + down.format(e=e), Slice(key, e)) for e in range(shape[0])]
    ffn = shape[1] // 2
    return [
        (layer + name.format(e=e), Slice(key, e, rows))
        for e in range(shape[0])
        for name, rows in ((gate, (0, ffn)), (up, (ffn, 2 * ffn)))
    ]


def unstacked(tensors: dict, model_type: object, where: str) -> dict:
    """``tensors`` (name -> tensor) with every expert stack written as the published per-expert
    tensors it holds (contiguous copies), and a renamed module under its published name."""
    published = plan(model_type, {k: tuple(v.shape) for k, v in tensors.items()}, where)
    stored = {s.stored if isinstance(s, Slice) else s for s in published.values()}
    out = {k: v for k, v in tensors.items() if k not in stored}
    for name, src in published.items():
        if isinstance(src, Slice):
            t = tensors[src.stored][src.expert]
            out[name] = (t if src.rows is None else t[src.rows[0] : src.rows[1]]).contiguous()
        else:
            out[name] = tensors[src]
    return out


def stacked_plan(
    model_type: object, specs: list[tuple[str, tuple[int, ...], object]], where: str
) -> tuple[list[tuple[str, tuple[int, ...], object]], dict[str, tuple[str, int]]]:
    """The tensors of ``specs`` (name, shape, dtype, in write order; the published per-expert
    names) as transformers 5 stores them with ``save_original_format=False``: each layer's experts
    in one ``gate_up_proj`` and one ``down_proj``, a renamed module under its 5.x name. Returns the
    stored specs (a stack where its first expert was) and ``{published name: (stored name, offset
    in elements)}`` for every tensor written into a stack or renamed (offset 0). Refused naming
    the layer: experts missing or of different shapes or dtypes."""
    if not isinstance(model_type, str) or model_type not in _PUBLISHED:
        raise PortingError(f"{where}: model_type {model_type!r} has no stacked expert form")
    (gate, up, down), renamed = _PUBLISHED[model_type]
    patterns = {
        which: re.compile(
            r"^(?P<layer>.*\.layers\.\d+\.)"
            + r"(?P<e>\d+)".join(re.escape(part) for part in name.split("{e}"))
            + "$"
        )
        for which, name in (("gate", gate), ("up", up), ("down", down))
    }
    by_name = {key: (shape, dtype) for key, shape, dtype in specs}
    layers: dict[str, dict[str, dict[int, str]]] = {}
    for key in by_name:
        for which, pattern in patterns.items():
            if m := pattern.match(key):
                layers.setdefault(m["layer"], {}).setdefault(which, {})[int(m["e"])] = key
    parts: dict[str, tuple[str, int]] = {}
    stacks: dict[str, tuple[tuple[int, ...], object]] = {}
    for layer, found in layers.items():
        count = 1 + max(e for experts in found.values() for e in experts)
        names = [found.get(w, {}).get(e) for w in ("gate", "up", "down") for e in range(count)]
        if None in names:
            raise PortingError(
                f"{where}: {layer}: not every one of {count} experts has its "
                "gate, up and down weights; they cannot be stacked"
            )
        shapes = {by_name[n] for n in names if patterns["down"].match(n) is None}
        downs = {by_name[n] for n in names if patterns["down"].match(n) is not None}
        if len(shapes) != 1 or len(downs) != 1:
            raise PortingError(
                f"{where}: {layer}: the experts' weights differ in shape or dtype; "
                "they cannot be stacked"
            )
        ((ffn, hidden), dtype), ((hidden2, ffn2), dtype2) = shapes.pop(), downs.pop()
        if (hidden2, ffn2, dtype2) != (hidden, ffn, dtype):
            raise PortingError(
                f"{where}: {layer}: down_proj {(hidden2, ffn2)} is not the "
                f"transpose of gate_proj {(ffn, hidden)}; they cannot be stacked"
            )
        gate_up, down_proj = f"{layer}mlp.experts.gate_up_proj", f"{layer}mlp.experts.down_proj"
        stacks[gate_up] = ((count, 2 * ffn, hidden), dtype)
        stacks[down_proj] = ((count, hidden, ffn), dtype)
        for e in range(count):
            parts[found["gate"][e]] = (gate_up, e * 2 * ffn * hidden)
            parts[found["up"][e]] = (gate_up, e * 2 * ffn * hidden + ffn * hidden)
            parts[found["down"][e]] = (down_proj, e * hidden * ffn)
    for key in by_name:
        for new, old in renamed.items():
            if key.endswith("." + old) and key.removesuffix(old) in layers:
                parts[key] = (key.removesuffix(old) + new, 0)
                stacks[key.removesuffix(old) + new] = by_name[key]
    out, placed = [], set()
    for key, shape, dtype in specs:
        stored = parts.get(key, (key, 0))[0]
        if stored in placed:
            continue
        placed.add(stored)
        out.append((stored, *stacks[stored]) if stored in stacks else (key, shape, dtype))
    return out, parts
