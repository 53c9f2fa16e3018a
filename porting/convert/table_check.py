"""A family's weight table checked against a config before any checkpoint tensor is read.

The HF reference model the family names is built on the meta device from the config alone; the
Megatron side is the model import and export already build without data (NeMo's lazily allocated
module, the meta-device model). The table is then run both ways on meta tensors: every HF tensor
the HF model has must be read by exactly one entry or ignored by one, every entry must read
tensors that exist, every Megatron parameter must be written exactly once, and each entry's
forward transform must give the Megatron parameter's shape and its inverse the HF tensors' shapes.
A failure names the family's file and the entry (``WEIGHTS[i]``) at fault, so a family author
learns what to fix before a multi-GB checkpoint is opened.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

from porting.contract.family import Family
from porting.contract.mapping import (
    MTP,
    Fused,
    Ignore,
    Rename,
    expand,
    resolve_target_names,
    stacked_part,
)
from porting.errors import PortingError


def hf_meta_shapes(family: Family, hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the family's HF reference model has for ``hf_config``, with its shape."""
    from accelerate import init_empty_weights

    from porting.contract.hf_spelling import transformers_config

    cls = family.hf_class(hf_config["architectures"][0])
    try:
        config = transformers_config(cls, hf_config)
        with init_empty_weights(include_buffers=True):
            model = cls._from_config(config, dtype=torch.float32)
    except Exception as err:
        # The reference implementation itself cannot run this config (transformers 4.57's YaRN
        # on a Mistral config without head_dim, 5.x's on one without an original length): there
        # is nothing to prove parity against. transformers 5's validators wrap the reason.
        said = "; ".join(
            f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            for e in (err, err.__cause__)
            if e is not None
        )
        raise PortingError(
            f"config.json: transformers' {cls.__name__} cannot be built from this config "
            f"({said}); the gate has no reference to compare against"
        ) from err
    # A tied output is one tensor under two names; safetensors files hold it once. transformers 5
    # holds a MoE layer's experts stacked; the table names them as published.
    from porting.convert.packed_experts import published_shapes

    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return published_shapes(hf_config.get("model_type"), shapes, f"transformers' {cls.__name__}")


def check_table(
    family: Family,
    ctx: Any,
    hf_shapes: dict[str, tuple[int, ...]],
    mcore_shapes: dict[str, tuple[int, ...]],
) -> None:
    """Raise :class:`PortingError` naming the family file and entry where the table and the two
    models disagree (see the module docstring); return quietly when they agree."""

    def entry(i: int) -> str:
        e = family.weights[i]
        target = f" -> {e.mcore}" if isinstance(e, Rename | Fused) else ""
        name = e.hf if isinstance(e, Rename | Ignore) else ", ".join(e.hf)
        return f"WEIGHTS[{i}] ({type(e).__name__} {name}{target})"

    def fail(msg: str) -> PortingError:
        return PortingError(f"family {family.name} ({family.source}): {msg}")

    concrete, ignores = expand(family.weights, ctx, ctx.num_layers)
    hf_shapes = dict(hf_shapes)
    slices: dict[str, set[int]] = {}
    for c in concrete:
        for key in c.hf:
            part = stacked_part(key)
            if part is not None and part[0] in hf_shapes and hf_shapes[part[0]]:
                # one expert's slice of a stacked tensor has the shape of its rows
                hf_shapes[key] = hf_shapes[part[0]][1:]
                slices.setdefault(part[0], set()).add(part[1])
    for name, got in slices.items():
        if got != set(range(hf_shapes[name][0])):
            raise fail(
                f"the table reads slices {sorted(got)} of HF tensor {name!r} {hf_shapes[name]}; "
                f"it stacks {hf_shapes[name][0]}"
            )
    concrete = resolve_target_names(concrete, mcore_shapes)
    for c in concrete:
        # transformers' classes build no multi-token-prediction layer: the HF shapes of an MTP
        # entry's tensors are those its inverse makes from Megatron's MTP block
        e = family.weights[c.entry]
        names = (e.hf,) if isinstance(e, Rename) else e.hf
        lacking = [k for k in c.hf if k not in hf_shapes]
        if lacking and any(MTP in n for n in names) and c.mcore in mcore_shapes:
            made = c.transform.inverse(torch.empty(mcore_shapes[c.mcore], device="meta"), ctx)
            for k, t in zip(c.hf, made, strict=True):
                hf_shapes.setdefault(k, tuple(t.shape))
    reader: dict[str, int] = {}
    writer: dict[str, int] = {}
    for c in concrete:
        i = c.entry
        for key in c.hf:
            if key in reader:
                raise fail(f"{entry(reader[key])} and {entry(i)} both read HF tensor {key!r}")
            if key not in hf_shapes:
                raise fail(
                    f"{entry(i)} reads HF tensor {key!r}, which this config's HF model lacks"
                )
            reader[key] = i
        if c.mcore in writer:
            raise fail(
                f"{entry(writer[c.mcore])} and {entry(i)} both write Megatron parameter {c.mcore!r}"
            )
        if c.mcore not in mcore_shapes:
            raise fail(
                f"{entry(i)} writes {c.mcore!r}, which this config's Megatron model does not have"
            )
        writer[c.mcore] = i
        inputs = [torch.empty(hf_shapes[k], device="meta") for k in c.hf]
        want = mcore_shapes[c.mcore]
        try:
            got = tuple(c.transform.forward(*inputs, ctx).shape)
            back = [
                tuple(t.shape) for t in c.transform.inverse(torch.empty(want, device="meta"), ctx)
            ]
        except (PortingError, RuntimeError, ValueError, IndexError) as err:
            shapes = ", ".join(f"{k} {hf_shapes[k]}" for k in c.hf)
            raise fail(f"{entry(i)}: {c.transform.name} fails on {shapes}: {err}") from err
        if got != want:
            raise fail(f"{entry(i)} makes {c.mcore!r} {got}; the Megatron config expects {want}")
        if back != [hf_shapes[k] for k in c.hf]:
            raise fail(
                f"{entry(i)}: the inverse of {c.transform.name} gives {back} for "
                f"{', '.join(c.hf)}, not {[hf_shapes[k] for k in c.hf]}"
            )
    for key, shape in hf_shapes.items():
        if key in slices:
            continue
        if key not in reader and not any(fnmatch.fnmatchcase(key, g.hf) for g in ignores):
            raise fail(
                f"no entry of WEIGHTS reads HF tensor {key!r} {shape} (add one, or Ignore it)"
            )
    unwritten = sorted(set(mcore_shapes) - set(writer))
    if unwritten:
        raise fail(
            f"no entry of WEIGHTS writes Megatron parameter(s) {', '.join(map(repr, unwritten[:5]))}"
            + (" ..." if len(unwritten) > 5 else "")
        )


def check_checkpoint_shapes(source, hf_shapes: dict[str, tuple[int, ...]], config_path) -> None:
    """Every tensor of the checkpoint that the config's HF model has must have that model's shape
    (from the headers, before any tensor is read); the error names the file, the tensor and the
    config. Missing and unknown tensors are the table plan's to name (:func:`plan_import`)."""
    for key in source.keys():
        want = hf_shapes.get(key)
        if want is None:
            continue
        got, where = source.shape(key)
        if tuple(got) != want:
            raise PortingError(
                f"{where}: tensor {key!r} is {tuple(got)}, but {config_path} makes it {want}"
            )
