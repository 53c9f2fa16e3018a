"""Granite MoE family <-> HF ``GraniteMoeForCausalLM`` (Granite 3.x mixture-of-experts):
config mapping, weight table.

Granite's decoder (:mod:`converters.granite`: the Llama attention and its four multipliers) with a
mixture of experts in every layer (transformers 4.57 and 5.x, ``models/granitemoe``):

- the router (``block_sparse_moe.router.layer``) takes the top ``num_experts_per_tok`` logits and
  softmaxes them (``GraniteMoeTopKGating``): Megatron-Core's router with
  ``moe_router_pre_softmax=False``, as Mixtral's;
- the experts are stored stacked, as transformers holds them (``GraniteMoeParallelExperts``):
  ``input_linear.weight`` ``[experts, 2 x intermediate, hidden]``, each expert's rows the gate then
  the up projection (``chunk(2)``), which is Megatron's gated ``linear_fc1``; and
  ``output_linear.weight`` ``[experts, hidden, intermediate]``, its ``linear_fc2``. The table reads
  one expert's slice of each (``[#]``).

``attention_bias`` is refused: it biases q/k/v/o but no expert, and Megatron's ``add_bias_linear``
biases every linear or none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from converters import granite, moe
from converters.llama import LLAMA_LAYOUT, ROPE_SCALING, head_dim_read_by
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from porting.contract.config_map import Carry, Derived, NoOp, Require
from porting.contract.family import Family, Variant
from porting.contract.mapping import Rename

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.granitemoe import GraniteMoeCore


def _experts_to_mcore(hf: dict) -> dict:
    k = hf.get("num_experts_per_tok", 2)
    return moe.router_order(k, False) | {
        "num_moe_experts": hf.get("num_local_experts", 8),
        "moe_router_topk": k,
        # every layer's MLP is the mixture, of experts intermediate_size wide
        "moe_ffn_hidden_size": hf["intermediate_size"],
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)),
    }


CONFIG = (
    *LLAMA_LAYOUT,
    ROPE_SCALING,
    head_dim_read_by("GraniteMoeAttention"),
    *(granite.multiplier(hf, mcore) for hf, mcore in granite.MULTIPLIERS.items()),
    Derived(
        ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"),
        _experts_to_mcore,
        lambda c: {},
    ),
    NoOp(
        "attention_bias",
        (False,),
        "it biases q/k/v and o_proj but no expert, and Megatron biases every linear or none",
    ),
    Carry("output_router_logits"),  # whether forward() also returns router logits
    # transformers 4.57's GraniteMoeConfig writes "rope" whatever it is given (5.x has no such
    # field); GraniteMoeModel builds no rotary embedding at any other value
    NoOp("position_embedding_type", ("rope",), "any other value builds no rotary embedding"),
    Require("model_type", lambda v: v == "granitemoe", "the HF side is the Granite MoE layout"),
)

_L = "model.layers.*."
_M = "decoder.layers.*."
_B = _L + "block_sparse_moe."
_EXPERT = _M + "mlp.experts.local_experts.#."

WEIGHTS = (
    # attention, norms, embeddings and output: the Llama table without its dense MLP
    *(e for e in LLAMA_WEIGHTS if ".mlp." not in getattr(e, "mcore", "")),
    Rename(_B + "router.layer.weight", _M + "mlp.router.weight"),
    Rename(_B + "input_linear.weight[#]", _EXPERT + "linear_fc1.weight"),
    Rename(_B + "output_linear.weight[#]", _EXPERT + "linear_fc2.weight"),
)


def shape_context(config: GraniteMoeCore, vocab_size: int) -> moe.MoEShapeContext:
    """Shape facts of a Granite MoE config for the table (``vocab_size``: the HF, unpadded one)."""
    return moe.MoEShapeContext.from_config(config, vocab_size, num_experts=config.num_moe_experts)


FAMILY = Family(
    name="granitemoe",
    architectures=("GraniteMoeForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.granitemoe_nemo:GraniteMoeConfig",
    model_cls="models.granitemoe_nemo:GraniteMoeModel",
    core_config_cls="models.granitemoe:GraniteMoeCore",
    shape_context=shape_context,
    context_symbols=("models.moe:moe_layer_spec",),
    summary="IBM Granite 3.x MoE: Granite's multipliers on Megatron-Core's MoE layer, top-k then "
    "softmax routing, stacked experts read by slice",
    variants=(
        Variant("granite3_moe", "Granite 3.x MoE layout: GQA, tied, top-2 of 4, the multipliers"),
        Variant("untied", "untied output, top-3, a head_dim given"),
    ),
)
