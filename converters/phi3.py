"""Phi-3 family <-> HF ``Phi3ForCausalLM`` (Phi-3, Phi-3.5, Phi-4-mini): config mapping, weight
table.

The Llama decoder with two fused projections and three config features (transformers 4.57,
``models/phi3``):

- ``qkv_proj`` is ``[q (heads x d); k (kv x d); v (kv x d)]`` on its output dimension
  (``Phi3Attention.forward`` slices it so): split, then interleaved per query group as Megatron's
  ``linear_qkv`` (:data:`FUSED_QKV`). ``gate_up_proj`` is ``[gate; up]`` (``Phi3MLP`` chunks it in
  that order), which is already Megatron's gated ``linear_fc1``: renamed as it is.
- ``partial_rotary_factor``: the first ``int(d x factor)`` channels of each head are rotated, the
  rest passed through; Megatron's ``rotary_percent`` is the same slice and frequency table.
- ``sliding_window``: ``Phi3Model`` builds its causal mask with ``create_sliding_window_causal_mask``
  whenever the config holds a window, so eager attention does apply it (keys ``i-W+1 .. i``);
  Megatron's ``window_size=(W-1, 0)`` as for Mistral.
- ``rope_scaling`` null, or ``longrope`` (``su`` its legacy name): two per-channel factor tables,
  the long one used when the sequence passes ``original_max_position_embeddings``, and cos/sin
  multiplied by ``sqrt(1 + ln(s) / ln(original))``, ``s = max_position_embeddings / original``
  (``modeling_rope_utils._compute_longrope_parameters``); :mod:`models.phi3`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from converters.llama import LLAMA_LAYOUT, PARTIAL_ROTARY
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from porting.contract.config_map import Derived, Field, NoOp, Require
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import Fused, Rename
from porting.contract.transforms import QKV, TransformPair
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.phi3 import Phi3Core

# the spellings transformers 4.57's Phi3Config reads as LongRoPE (_rope_scaling_adjustment renames
# "su" and "yarn" to it); "yarn" is refused, since it names another method everywhere else
_LONGROPE = ("longrope", "su")
_LONGROPE_KEYS = {"type", "short_factor", "long_factor"}


def _rotary_dims(hf: dict) -> int:
    """Channels rotated per head: ``int(head_dim * partial_rotary_factor)``, as transformers'
    rotary initialisers and Megatron's ``RotaryEmbedding`` both compute them."""
    return int(
        hf["hidden_size"] // hf["num_attention_heads"] * hf.get("partial_rotary_factor", 1.0)
    )


def _rotary_to_mcore(hf: dict) -> dict:
    """``partial_rotary_factor`` as Megatron's ``rotary_percent``, refused where the rotated width
    would be odd or zero (transformers' table is then narrower than the slice it rotates)."""
    factor = hf.get("partial_rotary_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise PortingError(
            f"config.json: partial_rotary_factor={factor!r} must be a number in (0, 1]"
        )
    dims = _rotary_dims(hf)
    if dims <= 0 or dims % 2:
        raise PortingError(
            f"config.json: partial_rotary_factor={factor!r} rotates {dims} channels of each head; "
            "it must be a positive even number"
        )
    return {"rotary_percent": float(factor)}


def _factors(rs: dict, key: str, n: int) -> list[float]:
    v = rs.get(key)
    ok = isinstance(v, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0
        for x in v
    )
    if not ok or len(v) != n:
        raise PortingError(
            f"config.json: rope_scaling.{key} must be a list of {n} finite numbers > 0 (one per "
            f"rotated channel pair), not {v!r}"
        )
    return [float(x) for x in v]


def _rope_to_mcore(hf: dict) -> dict:
    """``rope_scaling`` (null or LongRoPE) with ``original_max_position_embeddings``, which only
    LongRoPE reads."""
    rs = hf.get("rope_scaling")
    if rs is None:
        return {"longrope_short_factor": None}
    if not isinstance(rs, dict):
        raise PortingError(f"config.json: rope_scaling must be an object, not {rs!r}")
    kind = rs.get("type")
    if kind not in _LONGROPE:
        raise PortingError(
            f"config.json: rope_scaling type {kind!r} is not supported: transformers' Phi3Config "
            "takes only 'longrope' (or its legacy name 'su') under the key 'type'"
        )
    if set(rs) != _LONGROPE_KEYS:
        extra = sorted(set(rs) - _LONGROPE_KEYS) or sorted(_LONGROPE_KEYS - set(rs))
        raise PortingError(
            f"config.json: rope_scaling key(s) {', '.join(map(repr, extra))}: transformers' "
            "Phi3Config takes exactly type, short_factor and long_factor"
        )
    n = _rotary_dims(hf) // 2
    original = hf.get("original_max_position_embeddings", 4096)
    scale = hf["max_position_embeddings"] / original
    if scale > 1 and original < 2:
        # transformers' attention factor divides by ln(original_max_position_embeddings)
        raise PortingError(
            f"config.json: original_max_position_embeddings={original!r} must be at least 2 "
            "under LongRoPE"
        )
    attention = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    return {
        "longrope_short_factor": _factors(rs, "short_factor", n),
        "longrope_long_factor": _factors(rs, "long_factor", n),
        "longrope_original_max_position_embeddings": original,
        "longrope_attention_factor": attention,
    }


def _window_to_mcore(w):
    # HF admits keys i-W+1 .. i: Megatron's (W-1, 0) (see models.mistral)
    return None if w is None else (w - 1, 0)


CONFIG = (
    *(e for e in LLAMA_LAYOUT if e is not PARTIAL_ROTARY),
    Derived(("partial_rotary_factor",), _rotary_to_mcore, lambda c: {}),
    Derived(("rope_scaling", "original_max_position_embeddings"), _rope_to_mcore, lambda c: {}),
    Field(
        "sliding_window",
        "window_size",
        to_mcore=_window_to_mcore,
        to_hf=lambda ws: None if ws is None else ws[0] + 1,
        default=None,
    ),
    # dropout between the sublayers and the residual (Phi3DecoderLayer), Megatron's hidden_dropout;
    # the embedding's dropout is that same hidden_dropout in Megatron
    Field("resid_pdrop", "hidden_dropout", default=0.0),
    NoOp(
        "embd_pdrop",
        (0.0,),
        "Megatron drops embeddings out at hidden_dropout (resid_pdrop)",
        same_as="resid_pdrop",
    ),
    Require("model_type", lambda v: v == "phi3", "the HF side is the Phi-3 layout"),
    # Phi-4-mini's config names its remote code's biases, all off: transformers' Phi3 has none
    *(
        NoOp(name, (False,), "transformers' Phi3ForCausalLM has no such bias")
        for name in ("attention_bias", "mlp_bias", "lm_head_bias")
    ),
)


def _split_fused_qkv(t, ctx: ShapeContext):
    q = ctx.num_heads * ctx.head_dim
    kv = ctx.num_query_groups * ctx.head_dim
    return t.split([q, kv, kv], dim=0)


def _join_fused_qkv(t, ctx: ShapeContext):
    import torch

    return (torch.cat(QKV.inverse(t, ctx), dim=0),)


FUSED_QKV = TransformPair(
    "fused_qkv_interleave",
    lambda t, ctx: QKV.forward(*_split_fused_qkv(t, ctx), ctx),
    _join_fused_qkv,
)

_L = "model.layers.*."
_M = "decoder.layers.*."


def _hf_names(entry) -> str:
    hf = entry.hf
    return " ".join(hf) if isinstance(hf, tuple) else hf


# the Llama table's separate projections and its biases, which Phi-3 has not
_LLAMA_ONLY = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", ".bias")

WEIGHTS = (
    *(e for e in LLAMA_WEIGHTS if not any(s in _hf_names(e) for s in _LLAMA_ONLY)),
    Fused((_L + "self_attn.qkv_proj.weight",), _M + "self_attention.linear_qkv.weight", FUSED_QKV),
    Rename(_L + "mlp.gate_up_proj.weight", _M + "mlp.linear_fc1.weight"),
)


def shape_context(config: Phi3Core, vocab_size: int) -> ShapeContext:
    """Shape facts of a Phi-3 config for the table (``vocab_size`` is the HF, unpadded one)."""
    return ShapeContext.from_config(config, vocab_size)


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.phi3_nemo:Phi3Config",
    model_cls="models.phi3_nemo:Phi3Model",
    core_config_cls="models.phi3:Phi3Core",
    shape_context=shape_context,
    summary="Phi-3/3.5/4-mini: the Llama decoder with fused qkv and gate_up, partial rotary, "
    "sliding window and LongRoPE on the stock GPT spec",
    variants=(
        Variant("mini_window", "Phi-3-mini-4k layout: MHA, sliding window"),
        Variant("gqa_partial_tied", "Phi-4-mini layout: GQA, partial rotary, tied output"),
        Variant("longrope", "Phi-3-mini-128k / Phi-3.5-mini: LongRoPE short/long tables"),
    ),
)
