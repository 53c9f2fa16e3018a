"""Llama 4 family <-> HF ``Llama4ForCausalLM`` and the language model of
``Llama4ForConditionalGeneration`` (Scout, Maverick): config mapping, weight table.

The text model (transformers 4.57 and 5.x, ``modeling_llama4``), each piece as Megatron-Core
expresses it (:mod:`models.llama4`):

- **interleaved rotary** (``apply_rotary_emb`` rotates adjacent pairs as complex numbers):
  Megatron's ``rotary_interleaved``; the q/k rows are stored as transformers holds them. llama3
  scaling as Llama 3.1's.
- **rotary-free layers** by ``no_rope_layers`` (1 where the layer rotates; empty or absent: every
  ``no_rope_layer_interval``-th layer is rotary-free): ``no_rope_freq``.
- **L2 q/k norm** (``use_qk_norm``), a weightless RMS norm of each head, on the rotary layers
  only. transformers applies it after the rotation, Megatron before: the rotation keeps each
  head's sum of squares, so the two orders are the same function.
- **chunked attention** on the layers ``layer_types`` names ``chunked_attention`` (by default the
  rotary ones): a query attends to the earlier keys of its own ``attention_chunk_size`` block.
- **attention temperature** (``attn_temperature_tuning``, read as transformers 4.57 reads it, a
  number counting as its truth) on the rotary-free layers: each query times
  ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``.
- **the mixture**: on the layers ``moe_layers`` names (absent: every
  ``interleave_moe_layer_step``-th), ``num_local_experts`` SwiGLU experts of width
  ``intermediate_size`` routed top-1 by ``sigmoid`` of the chosen logit, **applied to the
  expert's input** (``moe_apply_probs_on_input``), plus an ungated shared expert of the same
  width; the other layers are a dense SwiGLU of width ``intermediate_size_mlp``.

HF stores each MoE layer's experts stacked: ``feed_forward.experts.gate_up_proj``
``(experts, hidden, 2 * ffn)`` (gate, then up, along the last dimension: Megatron's order) and
``down_proj`` ``(experts, ffn, hidden)``; the table reads one expert's slice (``[#]``) and
transposes it.

What Megatron-Core cannot run is refused by name: more than one expert per token (Megatron
weighs an expert's input by its score only at top-1), a chunked layer without a chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from converters.llama import (
    QUERY_GROUPS,
    ROPE_SCALING,
    layout_with_defaults,
    rotary_free_every_nth,
)
from porting.contract.config_map import (
    BOOL,
    LAYER_INDICES,
    NON_NEGATIVE_FLOAT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Carry,
    Derived,
    Field,
    NoOp,
    Require,
)
from porting.contract.container import Container
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import (
    EMBEDDING,
    FINAL_NORM_AND_HEAD,
    Fused,
    Rename,
    attention,
    gated_mlp,
)
from porting.contract.transforms import TRANSPOSE
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.llama4 import Llama4Core

CHUNKED, FULL = "chunked_attention", "full_attention"
# Llama4TextConfig's defaults where config.json leaves a key out (Scout's shapes)
DEFAULT_HEAD_DIM, DEFAULT_KV_HEADS, DEFAULT_MLP = 128, 8, 16384


def rope_layers(hf: dict) -> list[int]:
    """Per layer, 1 where it rotates q and k: ``no_rope_layers`` (a list at least as long as the
    model, read by index) or, where that is empty or absent, every
    ``no_rope_layer_interval``-th layer rotary-free (``Llama4TextConfig``)."""
    n = hf["num_hidden_layers"]
    given = hf.get("no_rope_layers")
    if not given:
        return rotary_free_every_nth(hf)
    ok = isinstance(given, list) and all(v in (0, 1) and not isinstance(v, bool) for v in given)
    if not ok or len(given) < n:
        raise PortingError(
            f"config.json: no_rope_layers={given!r} must list 0 or 1 for each of the {n} layers "
            "(1: the layer rotates q and k)"
        )
    return list(given[:n])


def moe_layers(hf: dict) -> list[int]:
    """Per layer, 1 where it is a mixture of experts: ``moe_layers`` as given, or every
    ``interleave_moe_layer_step``-th layer from the step's own (``Llama4TextConfig``)."""
    n = hf["num_hidden_layers"]
    given = hf.get("moe_layers")
    if given is None:
        step = hf.get("interleave_moe_layer_step", 1)
        if not POSITIVE_INT.ok(step):
            raise PortingError(
                f"config.json: interleave_moe_layer_step={step!r} must be a positive integer"
            )
        given = list(range(step - 1, n, step))
    if not LAYER_INDICES.ok(given) or any(i >= n for i in given):
        raise PortingError(f"config.json: moe_layers={given!r} must be indices of the {n} layers")
    return [int(i in given) for i in range(n)]


def _layers_to_mcore(hf: dict) -> dict:
    """The per-layer lists: rotary-free, chunked, mixture; and what each kind reads."""
    rotary = rope_layers(hf)
    types = hf.get("layer_types")
    n = hf["num_hidden_layers"]
    if types is None:
        # Llama4TextConfig derives one kind per entry of no_rope_layers, then checks the count
        given = hf.get("no_rope_layers")
        if given and len(given) != n:
            raise PortingError(
                f"config.json: no_rope_layers lists {len(given)} layers for {n}: without "
                "layer_types, transformers derives a layer kind from each entry and refuses "
                "the count"
            )
        types = [CHUNKED if r else FULL for r in rotary]
    if not isinstance(types, list) or len(types) != n or set(types) - {CHUNKED, FULL}:
        raise PortingError(
            f"config.json: layer_types={types!r} must name chunked_attention or full_attention "
            f"for each of the {n} layers (the masks Llama4TextModel builds)"
        )
    chunk = hf.get("attention_chunk_size", 8192)
    chunked = [int(t == CHUNKED) for t in types]
    if not POSITIVE_INT.ok(chunk):
        raise PortingError(
            f"config.json: attention_chunk_size={chunk!r} must be a positive integer: "
            "Llama4TextModel builds the chunked mask from it whatever layer_types says"
        )
    tuning = hf.get("attn_temperature_tuning", True)
    if not isinstance(tuning, (bool, int, float)):
        raise PortingError(
            f"config.json: attn_temperature_tuning={tuning!r} must be true or false (a number "
            "counts as its truth, as transformers 4.57 reads it)"
        )
    floor_scale, attn_scale = hf.get("floor_scale", 8192), hf.get("attn_scale", 0.1)
    if not bool(tuning):  # read by nothing then: carried as they are
        floor_scale, attn_scale = 8192, 0.1
    elif not (POSITIVE_FLOAT.ok(floor_scale) and NON_NEGATIVE_FLOAT.ok(attn_scale)):
        raise PortingError(
            f"config.json: floor_scale={floor_scale!r} and attn_scale={attn_scale!r} must be "
            "numbers > 0 and >= 0 where attn_temperature_tuning is on"
        )
    aux = hf.get("router_aux_loss_coef", 0.001)
    if not NON_NEGATIVE_FLOAT.ok(aux):
        raise PortingError(
            f"config.json: router_aux_loss_coef={aux!r} must be a finite number >= 0 (the "
            "load-balancing loss's weight in training)"
        )
    sparse = moe_layers(hf)
    k = hf.get("num_experts_per_tok", 1)
    if k != 1 and any(sparse):
        raise PortingError(
            f"config.json: num_experts_per_tok={k!r} is not supported: Llama 4 weighs each "
            "chosen expert's input by its score, which Megatron-Core does only at top-1 "
            "(moe_apply_probs_on_input)"
        )
    width = hf.get("intermediate_size", 8192)
    return {
        "no_rope_freq": [1 - r for r in rotary] if 0 in rotary else None,
        "chunked_attention_layers": chunked if any(chunked) else None,
        "attention_chunk_size": chunk if any(chunked) else None,
        "attn_temperature_tuning": bool(tuning) and 0 in rotary,
        "attn_floor_scale": float(floor_scale),
        "attn_scale": float(attn_scale),
        "moe_layer_freq": sparse,
        "num_moe_experts": hf.get("num_local_experts", 16),
        "moe_router_topk": k,
        "moe_ffn_hidden_size": width,
        "moe_shared_expert_intermediate_size": width,
        "ffn_hidden_size": hf.get("intermediate_size_mlp", DEFAULT_MLP),
        "moe_aux_loss_coeff": float(aux),
    }


def _heads_to_mcore(hf: dict) -> dict:
    # Llama4TextConfig: absent head_dim is 128, a null one hidden/heads; absent KV heads are 8,
    # null ones every head
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads", DEFAULT_KV_HEADS)
    head_dim = hf.get("head_dim", DEFAULT_HEAD_DIM)
    return {
        "num_query_groups": kv or heads,
        "kv_channels": head_dim or hf["hidden_size"] // heads,
    }


_LAYER_FIELDS = (
    "no_rope_layers",
    "no_rope_layer_interval",
    "layer_types",
    "attention_chunk_size",
    "attn_temperature_tuning",
    "floor_scale",
    "attn_scale",
    "moe_layers",
    "interleave_moe_layer_step",
    "num_local_experts",
    "num_experts_per_tok",
    "intermediate_size",
    "intermediate_size_mlp",
    "router_aux_loss_coef",
)
CONFIG = (
    # the Llama layout less what Llama 4 reads its own way: intermediate_size is the experts'
    # width, the KV heads and head_dim have Scout's defaults, the rotary pairs are interleaved
    *(
        e
        for e in layout_with_defaults(
            rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072
        )
        if getattr(e, "hf", None) not in ("intermediate_size", "rope_interleaved")
        and e is not QUERY_GROUPS
    ),
    ROPE_SCALING,
    Derived(("num_key_value_heads", "head_dim"), _heads_to_mcore, lambda c: {}),
    Derived(_LAYER_FIELDS, _layers_to_mcore, lambda c: {}),
    Field("use_qk_norm", "qk_l2_norm", default=True),
    NoOp(
        "attention_bias",
        (False,),
        "transformers 4.57's Llama4TextConfig sets it false whatever config.json says, 5.x reads "
        "it: the two would build different models",
    ),
    Carry("router_jitter_noise"),  # read by no Llama 4 class
    Carry("output_router_logits", check=BOOL),  # whether forward() also returns router logits
    Carry("for_llm_compressor", check=BOOL),  # a flag for llm-compressor, read by no class
    Carry("cache_implementation"),  # generation-time cache choice (Scout's "hybrid")
    Require("model_type", lambda v: v == "llama4_text", "the HF side is the Llama 4 text model"),
)


@dataclass(frozen=True)
class Llama4ShapeContext(ShapeContext):
    """Adds the expert count (the table's ``#``) and which layers are mixtures."""

    num_experts: int = 0
    moe_layers: tuple[int, ...] = ()


def _dense(c: Llama4ShapeContext, layer: int) -> bool:
    return layer not in c.moe_layers


def _sparse(c: Llama4ShapeContext, layer: int) -> bool:
    return layer in c.moe_layers


_L = "model.layers.*."
_M = "decoder.layers.*."
_F = _L + "feed_forward."
_S = _F + "shared_expert."
_EXPERT = _M + "mlp.experts.local_experts.#."
WEIGHTS = (
    EMBEDDING,
    Rename(_L + "input_layernorm.weight", _M + "input_layernorm.weight"),
    *attention(_L + "self_attn.", _M + "self_attention."),
    Rename(_L + "post_attention_layernorm.weight", _M + "pre_mlp_layernorm.weight"),
    *gated_mlp(_F, _M + "mlp.", layers=_dense),
    Rename(_F + "router.weight", _M + "mlp.router.weight", layers=_sparse),
    Fused(
        (_F + "experts.gate_up_proj[#]",), _EXPERT + "linear_fc1.weight", TRANSPOSE, layers=_sparse
    ),
    Fused((_F + "experts.down_proj[#]",), _EXPERT + "linear_fc2.weight", TRANSPOSE, layers=_sparse),
    *gated_mlp(_S, _M + "mlp.shared_experts.", layers=_sparse),
    *FINAL_NORM_AND_HEAD,
)


def shape_context(config: Llama4Core, vocab_size: int) -> Llama4ShapeContext:
    """Shape facts of a Llama 4 config for the table (``vocab_size`` is the HF, unpadded one)."""
    freq = config.moe_layer_freq
    sparse = tuple(i for i, f in enumerate(freq) if f) if isinstance(freq, list) else ()
    return Llama4ShapeContext.from_config(
        config, vocab_size, num_experts=config.num_moe_experts, moe_layers=sparse
    )


def plan_shape(cfg: dict, source: str, read) -> dict:
    """What the planner needs (``Family.plan_shape``): the Llama layout's reading with the
    experts' width, the dense layers' own width (``intermediate_size_mlp``), the shared expert
    and the layers ``moe_layers`` names."""
    # the layers' kinds are read here, not by the Llama layout's reader (which refuses keys
    # whose placement it does not know)
    placed = ("moe_layers", "interleave_moe_layer_step")
    shape = read.llama_layout({k: v for k, v in cfg.items() if k not in placed}, source)
    width = shape.get("moe_ffn") or read.need(cfg, source, "moe_ffn", "intermediate_size")
    dense = cfg.get("intermediate_size_mlp", DEFAULT_MLP)
    try:
        sparse = sum(moe_layers(cfg))
    except PortingError as err:
        raise PortingError(f"{source}: {err}") from None
    ffn = read.count(dense, "intermediate_size_mlp", source, "ffn")
    return shape | {"ffn": ffn, "shared_ffn": width, "moe_layers": sparse}


FAMILY = Family(
    name="llama4",
    architectures=("Llama4ForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.llama4_nemo:Llama4Config",
    model_cls="models.llama4_nemo:Llama4Model",
    core_config_cls="models.llama4:Llama4Core",
    shape_context=shape_context,
    context_symbols=("models.llama4:llama4_block_spec",),
    plan_shape=plan_shape,
    # Scout and Maverick as published: the language model inside the vision-language class,
    # which holds it at language_model (its own names are the stored ones)
    containers=(
        Container(
            "Llama4ForConditionalGeneration",
            "Llama4ForCausalLM",
            ((("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),),
        ),
    ),
    summary="Llama 4 (Scout, Maverick): interleaved rotary, rotary-free layers with attention "
    "temperature, chunked attention and L2 q/k norm on the rotary ones, top-1 sigmoid experts "
    "weighing their input plus a shared expert, dense layers between (custom attention spec)",
    variants=(
        Variant("scout", "every layer a mixture, L2 q/k norm, llama3 scaling (Scout layout)"),
        Variant("maverick", "dense and mixture layers alternating, no q/k norm (Maverick)"),
    ),
)
