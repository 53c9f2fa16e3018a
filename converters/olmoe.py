"""OLMoE family <-> HF ``OlmoeForCausalLM``: config mapping, weight table, NeMo connectors.

A pre-norm Llama-layout decoder whose attention norms q and k over the whole projection (as OLMo
2's, :mod:`models.olmo_attention`) and may clamp q, k and v (``clip_qkv``), and whose every MLP is a
router and ``num_experts`` SwiGLU experts under Qwen-MoE's names (``mlp.gate``,
``mlp.experts.N.{gate,up,down}_proj``): the MoE family's table and routing
(:mod:`converters.moe`), with no shared expert. Routing takes the top-k of the full softmax, or,
with ``norm_topk_prob``, renormalises it (:mod:`models.moe`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from converters import moe
from converters.llama import LLAMA_LAYOUT, ROPE_SCALING
from converters.olmo2 import attention_to_mcore
from porting.contract.config_map import Carry, Derived
from porting.contract.family import Family, Variant
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.olmoe import OlmoeCore


def _required(hf: dict, name: str):
    # transformers' defaults (64 experts, top-8) describe one model, not a config that omits them
    if name not in hf:
        raise PortingError(f"config.json: required field {name!r} is missing")
    return hf[name]


def _olmoe_to_mcore(hf: dict) -> dict:
    """The attention checks, the clamp, the experts and the routing order, read together."""
    attention_to_mcore(hf, "olmoe")
    # the value's type and range (a number > 0, or null) are the shared rule's (FIELD_RULES)
    clip = hf.get("clip_qkv")
    return {
        "clip_qkv": None if clip is None else float(clip),
        "num_moe_experts": _required(hf, "num_experts"),
        "moe_router_topk": _required(hf, "num_experts_per_tok"),
        "moe_ffn_hidden_size": hf["intermediate_size"],
        # without renormalisation HF takes the top-k of the full softmax
        **moe.router_order(
            _required(hf, "num_experts_per_tok"), not hf.get("norm_topk_prob", False)
        ),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.01)),
    }


CONFIG = (
    *LLAMA_LAYOUT,
    ROPE_SCALING,
    # every value is carried verbatim in the original config; export rewrites none of them
    Derived(
        (
            "model_type",
            "attention_bias",
            "clip_qkv",
            "num_experts",
            "num_experts_per_tok",
            "norm_topk_prob",
            "router_aux_loss_coef",
        ),
        _olmoe_to_mcore,
        lambda c: {},
    ),
    Carry("output_router_logits"),  # whether forward() also returns router logits
)

# The MoE family's table under an OLMoE shape context: the Qwen names, q/k norms (full-width
# here: the table check holds them to the Megatron model's shapes), no bias, no shared expert.
WEIGHTS = moe.WEIGHTS


def shape_context(config: OlmoeCore, vocab_size: int) -> moe.MoEShapeContext:
    """Shape facts of an OLMoE config for the table (``vocab_size`` is the HF, unpadded one)."""
    return moe.MoEShapeContext.from_config(
        config,
        vocab_size,
        qkv_bias=False,
        qk_norm=True,
        num_experts=config.num_moe_experts,
        mixtral=False,
        shared_expert=False,
    )


FAMILY = Family(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.olmoe_nemo:OlmoeConfig",
    model_cls="models.olmoe_nemo:OlmoeModel",
    core_config_cls="models.olmoe:OlmoeCore",
    shape_context=shape_context,
    context_symbols=("models.olmoe:olmoe_layer_spec",),
    summary="OLMoE: mixture of experts on Megatron-Core's MoE layer, q/k RMSNorm over the whole "
    "projection, optional q/k/v clamp; top-k of the full softmax as HF",
    variants=(
        Variant("olmoe", "OLMoE-1B-7B layout: top-k of the full softmax, MHA"),
        Variant("olmoe_norm_clip", "norm_topk_prob and clip_qkv, grouped KV heads, tied"),
    ),
)
