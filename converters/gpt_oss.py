"""gpt-oss family <-> HF ``GptOssForCausalLM`` (transformers 4.57): config mapping, weight table.

What differs from the Llama layout (:mod:`converters.llama`), each a Megatron-Core knob
(:mod:`models.gpt_oss`):

- a learnable attention sink per head (``self_attn.sinks``): one more logit in every softmax row,
  dropped after it (``softmax_type="learnable"``, the core attention's ``softmax_offset``);
- the ``layer_types`` pattern of sliding and full attention (``window_size`` with
  ``window_attn_skip_freq`` as a per-layer list) and YaRN (:data:`converters.llama.ROPE_SCALING`;
  a config.json without ``rope_scaling`` has ``GptOssConfig``'s YaRN default, an explicit null
  none);
- biases on q/k/v, o_proj, the router and every expert (``add_bias_linear``);
- the router: top-k of the biased logits, then the softmax of those k (``moe_router_pre_softmax``
  false), as ``GptOssTopKRouter`` does;
- the experts' clamped SwiGLU: ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)`` with
  ``g = clamp(gate, max=7)`` (Megatron's ``quick_gelu`` GLU with ``activation_func_clamp_value`` 7
  and ``glu_linear_offset`` 1). ``GptOssExperts`` hard-codes alpha and the limit: the config's
  ``swiglu_limit`` is carried at 7.0 and refused otherwise.

HF stores each layer's experts stacked (dequantized names): ``mlp.experts.gate_up_proj``
``(experts, hidden, 2 * ffn)`` with gate and up interleaved along the last dimension
(``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), its bias ``(experts, 2 * ffn)``, ``down_proj``
``(experts, ffn, hidden)`` and its bias. The table reads one expert's slice of each (``[#]``,
:mod:`porting.contract.mapping`) into that expert's Megatron module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from converters import moe
from converters.llama import FULL, LLAMA_LAYOUT, ROPE_SCALING, SLIDING, layer_windows
from porting.contract.config_map import Carry, Derived, Field, NoOp, Require
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import EMBEDDING, FINAL_NORM_AND_HEAD, Fused, Rename, attention
from porting.contract.transforms import TRANSPOSE, TransformPair
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    import torch

    from models.gpt_oss import GptOssCore

# GptOssExperts (transformers 4.57) fixes these; the original release's config names the limit
SWIGLU_LIMIT = 7.0


def _layout_to_mcore(hf: dict) -> dict:
    """Routing, window pattern and expert activation; absent fields take ``GptOssConfig``'s
    defaults (4 experts per token, window 128, sliding layers at even indices)."""
    k = hf.get("num_experts_per_tok", 4)
    if "experts_per_token" in hf and hf["experts_per_token"] != k:
        # the original release's name; transformers reads num_experts_per_tok alone
        raise PortingError(
            f"config.json: experts_per_token={hf['experts_per_token']!r} contradicts "
            f"num_experts_per_tok={k!r}, which transformers routes with"
        )
    limit = hf.get("swiglu_limit", SWIGLU_LIMIT)
    if limit != SWIGLU_LIMIT or isinstance(limit, bool):
        raise PortingError(
            f"config.json: swiglu_limit={limit!r} is not supported: transformers' GptOssExperts "
            f"clamps at {SWIGLU_LIMIT} whatever the config says, so no reference computes it"
        )
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [(SLIDING, FULL)[i % 2] for i in range(n)]
    window, pattern = layer_windows(hf, types, 128)
    return moe.router_order(k, False) | {
        "num_moe_experts": hf["num_local_experts"],
        "moe_router_topk": k,
        "moe_ffn_hidden_size": hf["intermediate_size"],
        "ffn_hidden_size": hf["intermediate_size"],  # every layer's MLP is the experts
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.9)),
        "window_size": window,
        "window_attn_skip_freq": pattern if window else None,
        "activation_func_clamp_value": SWIGLU_LIMIT,
    }


# GptOssConfig's rope_scaling where config.json has no such key (transformers 4.57)
DEFAULT_ROPE_SCALING = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _rope_to_mcore(hf: dict) -> dict:
    # only an absent key takes the default: an explicit null is no scaling, as in GptOssConfig;
    # export carries the original config.json back, so no key is added there
    if "rope_scaling" not in hf:
        hf = hf | {"rope_scaling": DEFAULT_ROPE_SCALING}
    return ROPE_SCALING.to_mcore(hf)


def _head_dim_to_mcore(hf: dict) -> dict:
    # GptOssConfig: an absent head_dim is 64, a null one hidden_size / num_attention_heads
    head_dim = hf.get("head_dim", 64)
    return {"kv_channels": head_dim or hf["hidden_size"] // hf["num_attention_heads"]}


_LAYOUT_FIELDS = (
    "num_local_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "intermediate_size",
    "router_aux_loss_coef",
    "layer_types",
    "sliding_window",
    "swiglu_limit",
)
CONFIG = (
    # the Llama layout less the fields gpt-oss reads its own way (intermediate_size is the
    # experts' width, rope_theta's default is 150000, hidden_act is never read)
    *(
        e
        for e in LLAMA_LAYOUT
        if getattr(e, "hf", None) not in ("rope_theta", "hidden_act", "intermediate_size")
    ),
    Field("rope_theta", "rotary_base", default=150000.0),
    Derived(("rope_scaling",), _rope_to_mcore, ROPE_SCALING.to_hf),
    Derived(("head_dim",), _head_dim_to_mcore, lambda c: {}),  # carried as the original has it
    Derived(_LAYOUT_FIELDS, _layout_to_mcore, lambda c: {}),
    NoOp(
        "attention_bias",
        (True,),
        "transformers' GptOssConfig biases q/k/v/o whatever config.json says",
    ),
    # transformers 5 writes the SwiGLU's alpha into the config; 4.57's GptOssExperts and
    # Megatron's quick_gelu both hard-code 1.702
    NoOp(
        "swiglu_alpha",
        (1.702,),
        "the experts' sigmoid(1.702 g) is fixed in transformers 4.57 and Megatron's quick_gelu",
    ),
    NoOp(
        "hidden_act",
        ("silu",),
        "transformers' GptOssExperts computes its clamped SwiGLU whatever hidden_act says",
    ),
    # the original release's context length before YaRN; transformers reads the rope_scaling copy
    Carry("initial_context_length"),
    Carry("output_router_logits"),  # whether forward() also returns router logits
    Require("model_type", lambda v: v == "gpt_oss", "the HF side is the gpt-oss layout"),
)


@dataclass(frozen=True)
class GptOssShapeContext(ShapeContext):
    """Adds the expert count (the table's ``#``) and the experts' width."""

    num_experts: int = 0
    ffn_hidden_size: int = 0


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """``[g0, u0, g1, u1, ...]`` along dim 0 to ``[g0, g1, ...; u0, u1, ...]``: HF's interleaved
    gate/up (``gate_up[..., ::2]``, ``[..., 1::2]``, modeling_gpt_oss.GptOssExperts) to Megatron's
    stacked GLU halves (``torch.chunk(x, 2, dim=-1)``, megatron/core/transformer/mlp.py)."""
    rest = t.shape[1:]
    # [2f, ...] -> [f, 2, ...] -> [2, f, ...] -> [2f, ...]
    return t.reshape(t.shape[0] // 2, 2, *rest).transpose(0, 1).reshape(t.shape).contiguous()


def interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`deinterleave_rows`."""
    rest = t.shape[1:]
    # [2f, ...] -> [2, f, ...] -> [f, 2, ...] -> [2f, ...]
    return t.reshape(2, t.shape[0] // 2, *rest).transpose(0, 1).reshape(t.shape).contiguous()


# one expert's gate_up_proj slice (hidden, 2f) -> linear_fc1.weight (2f, hidden)
INTERLEAVED_GATE_UP = TransformPair(
    "interleaved_gate_up_transposed",
    lambda t, ctx: deinterleave_rows(t.transpose(0, 1)),
    lambda t, ctx: (interleave_rows(t).transpose(0, 1).contiguous(),),
)
INTERLEAVED_GATE_UP_BIAS = TransformPair(
    "interleaved_gate_up",
    lambda t, ctx: deinterleave_rows(t),
    lambda t, ctx: (interleave_rows(t),),
)

_L = "model.layers.*."
_M = "decoder.layers.*."
_X = _L + "mlp.experts."
_EXPERT = _M + "mlp.experts.local_experts.#."
_ATTN = _L + "self_attn."
WEIGHTS = (
    EMBEDDING,
    Rename(_L + "input_layernorm.weight", _M + "input_layernorm.weight"),
    *attention(_ATTN, _M + "self_attention.", qkv_bias=True, proj_bias=True),
    Rename(_ATTN + "sinks", _M + "self_attention.core_attention.softmax_offset"),
    Rename(_L + "post_attention_layernorm.weight", _M + "pre_mlp_layernorm.weight"),
    Rename(_L + "mlp.router.weight", _M + "mlp.router.weight"),
    Rename(_L + "mlp.router.bias", _M + "mlp.router.bias"),
    Fused((_X + "gate_up_proj[#]",), _EXPERT + "linear_fc1.weight", INTERLEAVED_GATE_UP),
    Fused((_X + "gate_up_proj_bias[#]",), _EXPERT + "linear_fc1.bias", INTERLEAVED_GATE_UP_BIAS),
    Fused((_X + "down_proj[#]",), _EXPERT + "linear_fc2.weight", TRANSPOSE),
    Rename(_X + "down_proj_bias[#]", _EXPERT + "linear_fc2.bias"),
    *FINAL_NORM_AND_HEAD,
)


def shape_context(config: GptOssCore, vocab_size: int) -> GptOssShapeContext:
    """Shape facts of a gpt-oss config for the table (``vocab_size`` is the HF, unpadded one)."""
    return GptOssShapeContext.from_config(
        config,
        vocab_size,
        attention_bias=True,
        mlp_bias=True,
        num_experts=config.num_moe_experts,
        ffn_hidden_size=config.moe_ffn_hidden_size,
    )


FAMILY = Family(
    name="gpt-oss",
    architectures=("GptOssForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.gpt_oss_nemo:GptOssConfig",
    model_cls="models.gpt_oss_nemo:GptOssModel",
    core_config_cls="models.gpt_oss:GptOssCore",
    shape_context=shape_context,
    context_symbols=(
        "models.gpt_oss:gpt_oss_layer_spec",
        "megatron.core.fusions.fused_bias_geglu:quick_gelu",
    ),
    summary="gpt-oss on Megatron-Core's MoE layer: attention sinks, alternating sliding window, "
    "YaRN, biased router and experts, clamped SwiGLU with its +1 offset",
    variants=(
        Variant(
            "yarn", "YaRN (factor 32, truncate false), alternating window, sinks (as published)"
        ),
        Variant("no_scaling", "the same without rope_scaling"),
    ),
)
