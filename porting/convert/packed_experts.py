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
        for model_type in ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "kimi_k2")
    },
}  # fmt: skip
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
