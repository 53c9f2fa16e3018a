"""MoE family <-> HF ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``:
config mapping, weight table, NeMo connectors.

Attention and norms are the Qwen/Llama table (:mod:`converters.qwen`); every MLP is a router and
``#`` experts (the table's expert wildcard), plus Qwen2-MoE's gated shared expert. The routing
choice each HF config implies is in :mod:`models.moe`. What the family refuses, by name: dense
layers between sparse ones (``decoder_sparse_step`` other than 1, ``mlp_only_layers``), Qwen's
sliding window, Qwen3-MoE's ``attention_bias``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from converters import qwen
from converters.llama import HEAD_DIM_OR_NULL, LLAMA_LAYOUT, ROPE_SCALING, check_model_type
from porting.contract.config_map import Carry, Derived
from porting.contract.family import Family, Variant
from porting.contract.mapping import Rename, gated_mlp
from porting.errors import PortingError

_MODEL_TYPES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MIXTRAL_ONLY = ("num_local_experts", "router_jitter_noise")
_QWEN_ONLY = (
    "num_experts",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
)
_FIELDS = (
    "model_type",
    *_MIXTRAL_ONLY,
    *_QWEN_ONLY,
    "num_experts_per_tok",
    "shared_expert_intermediate_size",
    "qkv_bias",
    "attention_bias",
    "sliding_window",
    "router_aux_loss_coef",
)

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.moe import MoECore


def _required(hf: dict, name: str):
    # its type and range are the shared rule's (config_map.FIELD_RULES), checked before this runs
    if name not in hf:
        raise PortingError(f"config.json: required field {name!r} is missing")
    return hf[name]


def _not_here(hf: dict, names, which: str) -> None:
    present = [k for k in names if k in hf]
    if present:
        raise PortingError(f"config.json: {', '.join(present)} are not {which} fields")


def router_order(k: int, pre_softmax: bool) -> dict:
    """``moe_router_pre_softmax`` for a router of top ``k``: softmax over every expert before the
    top-k (``True``), or over the top-k logits after it. At top-1 the latter weighs every token's
    expert by exactly 1, and Megatron-Core's router takes top-1 only after a softmax over every
    expert (its config refuses the other order there), which weighs it below 1: refused by name."""
    if k == 1 and not pre_softmax:
        raise PortingError(
            "config.json: num_experts_per_tok=1 with the softmax taken over the chosen logit "
            "weighs each token's expert by exactly 1; Megatron-Core's router takes top-1 only "
            "after a softmax over every expert (moe_router_pre_softmax), which weighs it below 1"
        )
    return {"moe_router_pre_softmax": pre_softmax}


def _moe_to_mcore(hf: dict) -> dict:
    mtype = check_model_type(hf, _MODEL_TYPES)
    out = {
        "moe_router_topk": _required(hf, "num_experts_per_tok"),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    if mtype == "mixtral":
        _not_here(
            hf,
            (*_QWEN_ONLY, "shared_expert_intermediate_size", "qkv_bias", "attention_bias"),
            "Mixtral",
        )
        window = hf.get("sliding_window")
        return (
            out
            | router_order(out["moe_router_topk"], False)
            | {
                "num_moe_experts": _required(hf, "num_local_experts"),
                "moe_ffn_hidden_size": hf["intermediate_size"],
                # HF renormalises the top-k of the softmax: the softmax of the top-k logits
                # the same training-time noise: inputs times U(1 - eps, 1 + eps)
                "moe_input_jitter_eps": float(hf.get("router_jitter_noise", 0.0)) or None,
                "window_size": None if window is None else (window - 1, 0),
                "add_qkv_bias": False,
                "qk_layernorm": False,
                "hf_mlp_layout": "mixtral",
            }
        )
    _not_here(hf, _MIXTRAL_ONLY, "Qwen-MoE")
    qwen.window_to_mcore(hf)
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise PortingError(
            f"config.json: decoder_sparse_step={hf.get('decoder_sparse_step')!r} with "
            f"mlp_only_layers={hf.get('mlp_only_layers')!r} makes some layers dense; only "
            "all-sparse models (step 1, no mlp_only_layers) are supported"
        )
    norm = hf.get("norm_topk_prob", False)
    # without renormalisation HF takes the top-k of the full softmax
    out |= router_order(out["moe_router_topk"], not norm) | {
        "num_moe_experts": _required(hf, "num_experts"),
        "moe_ffn_hidden_size": _required(hf, "moe_intermediate_size"),
        "hf_mlp_layout": "qwen",
    }
    if mtype == "qwen2_moe":
        _not_here(hf, ("attention_bias",), "Qwen2-MoE")
        heads, hidden, head_dim = hf["num_attention_heads"], hf["hidden_size"], hf.get("head_dim")
        if (head_dim or hidden // heads) * heads != hidden:
            # Qwen2MoeAttention (transformers 4.57) raises unless heads x head_dim is hidden_size
            raise PortingError(
                f"config.json: head_dim={head_dim!r} with num_attention_heads={heads} must make "
                f"hidden_size={hidden}: Qwen2-MoE's attention is exactly hidden_size wide"
            )
        shared = hf.get("shared_expert_intermediate_size")
        return out | {
            "moe_shared_expert_intermediate_size": shared or None,
            "moe_shared_expert_gate": bool(shared),
            "add_qkv_bias": hf.get("qkv_bias", True),
            "qk_layernorm": False,
        }
    _not_here(hf, ("shared_expert_intermediate_size", "qkv_bias"), "Qwen3-MoE")
    if hf.get("attention_bias", False) is not False:
        raise PortingError(
            f"config.json: attention_bias={hf['attention_bias']!r} is not supported: it biases "
            "o_proj without the MLP, which Megatron cannot express"
        )
    return out | {"add_qkv_bias": False, "qk_layernorm": True}


def _rotary_base(hf: dict) -> dict:
    # left out: the config class's default, MixtralConfig's 1e6, Qwen2-MoE's and Qwen3-MoE's 1e4
    mixtral = hf["architectures"][0] == "MixtralForCausalLM"
    return {"rotary_base": float(hf.get("rope_theta", 1e6 if mixtral else 1e4))}


CONFIG = (
    *(e for e in LLAMA_LAYOUT if getattr(e, "hf", None) != "rope_theta"),
    Derived(("rope_theta",), _rotary_base, lambda c: {"rope_theta": c.rotary_base}),
    ROPE_SCALING,
    HEAD_DIM_OR_NULL,
    qwen.USE_MROPE,  # Qwen2.5/Qwen3-MoE configs may say use_mrope: false as the dense ones do
    Derived(_FIELDS, _moe_to_mcore, lambda c: {}),  # carried verbatim in the original config
    Carry("output_router_logits"),  # whether forward() also returns router logits
)


@dataclass(frozen=True)
class MoEShapeContext(qwen.QwenShapeContext):
    """Adds the expert count (the table's ``#``) and which HF layout names the MLP."""

    num_experts: int = 0
    mixtral: bool = False
    shared_expert: bool = False


_L = "model.layers.*."
_M = "decoder.layers.*."
_EXPERT = _M + "mlp.experts.local_experts.#."


def _mixtral(c: MoEShapeContext) -> bool:
    return c.mixtral


def _qwen(c: MoEShapeContext) -> bool:
    return not c.mixtral


def _shared(c: MoEShapeContext) -> bool:
    return c.shared_expert


_B = _L + "block_sparse_moe."
WEIGHTS = (
    # attention, norms, embeddings and output: the Qwen table without its dense MLP
    *(e for e in qwen.WEIGHTS if ".mlp." not in getattr(e, "mcore", "")),
    Rename(_B + "gate.weight", _M + "mlp.router.weight", when=_mixtral),
    *gated_mlp(_B + "experts.#.", _EXPERT, gate="w1", up="w3", down="w2", when=_mixtral),
    Rename(_L + "mlp.gate.weight", _M + "mlp.router.weight", when=_qwen),
    *gated_mlp(_L + "mlp.experts.#.", _EXPERT, when=_qwen),
    *gated_mlp(_L + "mlp.shared_expert.", _M + "mlp.shared_experts.", when=_shared),
    Rename(
        _L + "mlp.shared_expert_gate.weight", _M + "mlp.shared_experts.gate_weight", when=_shared
    ),
)


def shape_context(config: MoECore, vocab_size: int) -> MoEShapeContext:
    """Shape facts of an MoE config for the table (``vocab_size`` is the HF, unpadded one)."""
    return MoEShapeContext.from_config(
        config,
        vocab_size,
        qkv_bias=config.add_qkv_bias,
        qk_norm=config.qk_layernorm,
        num_experts=config.num_moe_experts,
        mixtral=config.hf_mlp_layout == "mixtral",
        shared_expert=config.moe_shared_expert_intermediate_size is not None,
    )


FAMILY = Family(
    name="moe",
    architectures=tuple(_MODEL_TYPES),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.moe_nemo:MoEConfig",
    model_cls="models.moe_nemo:MoEModel",
    core_config_cls="models.moe:MoECore",
    shape_context=shape_context,
    context_symbols=("models.moe:moe_layer_spec",),
    summary="mixture of experts on Megatron-Core's MoE layer: Mixtral, Qwen2-MoE (gated shared "
    "expert), Qwen3-MoE (QK-norm); router top-k and softmax order as HF",
    variants=(
        Variant("mixtral", "8 experts, top-2, renormalised (Mixtral-8x7B layout)"),
        Variant("mixtral_window", "Mixtral with a sliding window"),
        Variant("qwen2_moe", "top-k of the full softmax, gated shared expert, q/k/v biases"),
        Variant("qwen3_moe", "renormalised top-k (norm_topk_prob), QK-norm, no shared expert"),
    ),
)
