"""Declarative weight mapping between a Hugging Face checkpoint and a Megatron-Core model.

A family's mapping is one module-level tuple of typed entries:

- :class:`Rename` - one HF tensor is one Megatron tensor, unchanged;
- :class:`Fused`  - several (or one) HF tensors become one Megatron tensor through a
  :class:`~porting.contract.transforms.TransformPair`, whose inverse serves export;
- :class:`Ignore` - an HF key that is deliberately not carried (a buffer recomputed from config).

Patterns use ``*`` for the layer index and ``#`` for the expert index of mixture-of-experts
layers, and ``@`` for a multi-token-prediction layer of Megatron-Core's MTP block
(``ctx.mtp_layers`` of them): ``i`` in Megatron names (``mtp.layers.@.``), ``num_layers + i`` in HF
names, where checkpoints that carry such layers put them (DeepSeek-V3's ``model.layers.61.*``). An entry may carry ``when``, a predicate on the shape
context, for parts that exist only in some configs (biases, an untied output layer), and
``layers``, a predicate ``(ctx, layer index)``, for parts that only some layers have (the dense
MLP of a model whose first layers are dense and the rest mixtures of experts).

An HF name ending in ``[#]`` reads one expert's slice of a tensor that stacks every expert along
its first dimension (gpt-oss's ``mlp.experts.gate_up_proj``, ``(experts, hidden, 2 * ffn)``):
``model.layers.*.mlp.experts.down_proj[#]`` is expert ``#``'s ``(ffn, hidden)`` slice. The engine
reads the stacked tensor once for all its slices and, on export, stacks the slices back into one
tensor in expert order (:func:`stacked_part`).

Import and export are both driven by :func:`expand`; :mod:`porting.convert.mapping` applies the
expanded table and accounts for every key. Pure: imports neither torch nor NeMo.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from porting.contract.transforms import GATED_MLP, IDENTITY, QKV, VOCAB_PAD, TransformPair

Predicate = Callable[[Any], bool]
LayerPredicate = Callable[[Any, int], bool]


@dataclass(frozen=True)
class Rename:
    """One HF tensor maps to one Megatron tensor unchanged."""

    hf: str
    mcore: str
    when: Predicate | None = None
    layers: LayerPredicate | None = None


@dataclass(frozen=True)
class Fused:
    """HF tensors ``hf`` (in order) map to Megatron tensor ``mcore`` through ``transform``."""

    hf: tuple[str, ...]
    mcore: str
    transform: TransformPair
    when: Predicate | None = None
    layers: LayerPredicate | None = None


@dataclass(frozen=True)
class Ignore:
    """HF keys matching ``hf`` (an fnmatch pattern) are skipped on purpose; ``reason`` says why."""

    hf: str
    reason: str
    when: Predicate | None = None


Entry = Rename | Fused | Ignore


def _untied(c) -> bool:
    return not c.tied_output


def _tied(c) -> bool:
    return c.tied_output


# A decoder laid out as transformers' Llama is (and most are): its embedding, padded to Megatron's
# vocabulary, and its final norm and output layer, tied or not.
EMBEDDING = Fused(("model.embed_tokens.weight",), "embedding.word_embeddings.weight", VOCAB_PAD)
FINAL_NORM_AND_HEAD = (
    Rename("model.norm.weight", "decoder.final_layernorm.weight"),
    Fused(("lm_head.weight",), "output_layer.weight", VOCAB_PAD, when=_untied),
    Ignore(
        "lm_head.weight",
        "tied to model.embed_tokens.weight; transformers ignores it too",
        when=_tied,
    ),
)


def gated_mlp(
    hf: str,
    mcore: str,
    *,
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    when: Predicate | None = None,
    layers: LayerPredicate | None = None,
) -> tuple[Fused, Rename]:
    """A gated MLP's two entries, as most families store one (a dense MLP, each expert, a shared
    expert): HF's ``{hf}{gate}.weight`` and ``{hf}{up}.weight`` fused into Megatron's
    ``{mcore}linear_fc1.weight``, ``{hf}{down}.weight`` renamed ``{mcore}linear_fc2.weight``."""
    return (
        Fused(
            (f"{hf}{gate}.weight", f"{hf}{up}.weight"),
            f"{mcore}linear_fc1.weight",
            GATED_MLP,
            when=when,
            layers=layers,
        ),
        Rename(f"{hf}{down}.weight", f"{mcore}linear_fc2.weight", when=when, layers=layers),
    )


def attention(
    hf: str,
    mcore: str,
    *,
    qkv_bias: Predicate | bool = False,
    proj_bias: Predicate | bool = False,
    layers: LayerPredicate | None = None,
) -> tuple[Entry, ...]:
    """A self-attention's projections, as the Llama layout stores them: HF's
    ``{hf}q_proj``, ``k_proj`` and ``v_proj`` fused into Megatron's ``{mcore}linear_qkv`` (per
    query group, :data:`QKV`), ``{hf}o_proj`` renamed ``{mcore}linear_proj``. A bias is
    ``False``: none; ``True``: always stored; a predicate: stored where it holds."""

    def biased(bias: Predicate | bool) -> dict | None:
        if bias is False:
            return None
        return {"when": None if bias is True else bias, "layers": layers}

    def qkv(part: str) -> tuple[str, ...]:
        return tuple(f"{hf}{x}_proj.{part}" for x in "qkv")

    entries: list[Entry] = [Fused(qkv("weight"), f"{mcore}linear_qkv.weight", QKV, layers=layers)]
    if (kw := biased(qkv_bias)) is not None:
        entries.append(Fused(qkv("bias"), f"{mcore}linear_qkv.bias", QKV, **kw))
    entries.append(Rename(f"{hf}o_proj.weight", f"{mcore}linear_proj.weight", layers=layers))
    if (kw := biased(proj_bias)) is not None:
        entries.append(Rename(f"{hf}o_proj.bias", f"{mcore}linear_proj.bias", **kw))
    return tuple(entries)


@dataclass(frozen=True)
class Concrete:
    """One entry with its wildcards filled in; ``entry`` is its index in the family's table."""

    hf: tuple[str, ...]
    mcore: str
    transform: TransformPair
    entry: int = -1


# Transformer Engine fuses the pre-attention and pre-MLP norms into the following linear layer
# (megatron/core/models/gpt/gpt_layer_specs.py, get_gpt_layer_with_transformer_engine_spec); the
# local spec keeps them as modules. Tables are written with the local names; this is the one place
# that maps them onto a TE model's parameter names.
TE_FUSED_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


LAYER, EXPERT, MTP = "*", "#", "@"
_PART = re.compile(r"(.+)\[(\d+)\]\Z")


def stacked_part(key: str) -> tuple[str, int] | None:
    """``(tensor, index)`` for a concrete key naming one slice of a stacked tensor
    (``'m.layers.0.mlp.experts.down_proj[3]'`` -> ``('m.layers.0.mlp.experts.down_proj', 3)``);
    ``None`` for a whole tensor. No checkpoint names a tensor with brackets."""
    m = _PART.match(key)
    return None if m is None else (m[1], int(m[2]))


def stored_key(key: str) -> str:
    """The checkpoint tensor a concrete key reads: itself, or the stacked tensor it slices."""
    part = stacked_part(key)
    return key if part is None else part[0]


def _fill(pattern: str, layer: int | None, expert: int | None, mtp: int | None = None) -> str:
    if mtp is not None:
        pattern = pattern.replace(MTP, str(mtp))
    if layer is not None:
        pattern = pattern.replace(LAYER, str(layer))
    if expert is not None:
        pattern = pattern.replace(EXPERT, str(expert))
    return pattern


def _hf_mtp(num_layers: int, mtp: int | None) -> int | None:
    return None if mtp is None else num_layers + mtp


def expand(
    table: Iterable[Entry], ctx: Any, num_layers: int
) -> tuple[list[Concrete], list[Ignore]]:
    """Expand the wildcards and drop entries whose ``when`` is false for ``ctx``.

    ``*`` stands for the layer index (``num_layers``, those the entry's ``layers`` admits), ``#``
    for the expert index (``ctx.num_experts``, for mixture-of-experts families), in HF and
    Megatron names alike; ``@`` for each of ``ctx.mtp_layers`` multi-token-prediction layers,
    ``num_layers + i`` in HF names and ``i`` in Megatron's.
    """
    concrete: list[Concrete] = []
    ignores: list[Ignore] = []
    for index, entry in enumerate(table):
        if entry.when is not None and not entry.when(ctx):
            continue
        if isinstance(entry, Ignore):
            ignores.append(entry)
            continue
        hf = (entry.hf,) if isinstance(entry, Rename) else entry.hf
        transform = IDENTITY if isinstance(entry, Rename) else entry.transform
        names = (entry.mcore, *hf)
        layers = range(num_layers) if any(LAYER in k for k in names) else [None]
        if entry.layers is not None and layers != [None]:
            layers = [i for i in layers if entry.layers(ctx, i)]
        experts = range(ctx.num_experts) if any(EXPERT in k for k in names) else [None]
        mtps = range(getattr(ctx, "mtp_layers", 0)) if any(MTP in k for k in names) else [None]
        for layer in layers:
            for expert in experts:
                for m in mtps:
                    concrete.append(
                        Concrete(
                            tuple(_fill(k, layer, expert, _hf_mtp(num_layers, m)) for k in hf),
                            _fill(entry.mcore, layer, expert, m),
                            transform,
                            index,
                        )
                    )
    return concrete, ignores


def resolve_target_names(entries: list[Concrete], target_names: Iterable[str]) -> list[Concrete]:
    """Rename table targets to the names the model really has (local vs Transformer Engine spec)."""
    names = set(target_names)
    resolved = []
    for c in entries:
        name = c.mcore
        if name not in names:
            for local, te in TE_FUSED_NORM_NAMES.items():
                if name.endswith(local) and name[: -len(local)] + te in names:
                    name = name[: -len(local)] + te
                    break
        resolved.append(Concrete(c.hf, name, c.transform, c.entry))
    return resolved
