"""DeepSeek-V2 family <-> HF ``DeepseekV2ForCausalLM`` (DeepSeek-V2-Lite and its chat and coder
checkpoints): config mapping, weight table.

The layers are DeepSeek-V3's (:mod:`converters.deepseek`: multi-latent attention with or without
a query latent, dense first layers, routed experts plus a shared expert, every tensor a rename)
without the expert bias. What differs is the arithmetic transformers' ``DeepseekV2`` classes do
(4.57 and 5.x alike), which is not the remote code's:

- **Routing** (``DeepseekV2MoEGate`` / ``DeepseekV2Moe.route_tokens_to_experts``): a softmax over
  every expert, the top ``num_experts_per_tok`` of it unrenormalised (``norm_topk_prob`` is read by
  neither class), times ``routed_scaling_factor``: Megatron-Core's router with
  ``moe_router_pre_softmax`` and a softmax score. ``group_limited_greedy`` (DeepSeek-V2 and V2.5:
  top-6 of 3 of 8 groups) is refused by name: transformers scores a group by its best expert,
  Megatron-Core by the sum of its best ``num_experts_per_tok // topk_group``, and transformers 5's
  class fails on the method.
- **YaRN**: transformers scales cos and sin by the attention factor (``mscale / mscale_all_dim``
  through ``get_mscale`` where both are set, else ``get_mscale(factor)``) but leaves the softmax
  scale at ``1 / sqrt(qk_head_dim)``, where DeepSeek's own code and the V3 class multiply it by
  ``get_mscale(factor, mscale_all_dim) ** 2``. Megatron-Core computes the softmax scale from
  ``mscale_all_dim`` and the rotary scale from both, so the family sets ``mscale_all_dim`` to 0
  (a scale of 1) and ``mscale`` to the value whose ``get_mscale`` is transformers' factor:
  DeepSeek-V2-Lite's equal 0.707s give a factor of 1 and ``mscale`` 0.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from converters import deepseek
from porting.contract.config_map import Carry, Derived, Field, NoOp, Require
from porting.contract.family import Family, Variant
from porting.contract.mapping import EMBEDDING, FINAL_NORM_AND_HEAD
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.deepseek_v2 import DeepseekV2Core


def _count(hf: dict, name: str, default, at_least: int = 1) -> int:
    v = hf.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < at_least:
        raise PortingError(f"config.json: {name} must be an integer >= {at_least}, not {v!r}")
    return v


def _moe_to_mcore(hf: dict) -> dict:
    """transformers' DeepSeek-V2 routing as Megatron-Core's softmax router (module docstring)."""
    layers = hf["num_hidden_layers"]
    experts = _count(hf, "n_routed_experts", 64)
    # DeepseekV2Config's default is None, which its top-k cannot take
    k = hf.get("num_experts_per_tok")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= experts:
        raise PortingError(
            f"config.json: num_experts_per_tok={k!r} must be an integer from 1 to "
            f"n_routed_experts={experts}"
        )
    method = hf.get("topk_method", "greedy")
    if method == "group_limited_greedy":
        raise PortingError(
            "config.json: topk_method='group_limited_greedy' (DeepSeek-V2, V2.5) is not "
            "supported: transformers scores each group by its best expert and Megatron-Core by "
            f"the sum of its best num_experts_per_tok // topk_group (here {k} // "
            f"{hf.get('topk_group')!r}), and transformers 5's DeepseekV2Moe fails on the method "
            "(it reads an attribute it never sets), so the gate would have no reference"
        )
    if method != "greedy":
        raise PortingError(
            f"config.json: topk_method={method!r} is not supported: transformers' DeepseekV2 "
            "classes route by greedy and group_limited_greedy only"
        )
    # greedy reads no groups; DeepSeek-V2-Lite's config still says 1 and 1
    for name in ("n_group", "topk_group"):
        if hf.get(name) is not None:
            _count(hf, name, None)
    scaling = hf.get("routed_scaling_factor", 1.0)
    if not isinstance(scaling, int | float) or isinstance(scaling, bool) or not scaling > 0:
        raise PortingError(
            f"config.json: routed_scaling_factor must be a finite number > 0, not {scaling!r}"
        )
    dense = _count(hf, "first_k_dense_replace", 0, at_least=0)
    if dense > layers:
        raise PortingError(
            f"config.json: first_k_dense_replace={dense} must be at most num_hidden_layers={layers}"
        )
    alpha = hf.get("aux_loss_alpha", 0.001)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha < 0:
        raise PortingError(f"config.json: aux_loss_alpha must be a number >= 0, not {alpha!r}")
    if not isinstance(hf.get("seq_aux", True), bool):
        raise PortingError(f"config.json: seq_aux must be true or false, not {hf['seq_aux']!r}")
    # transformers' forward adds the shared experts whatever; None would fail there
    shared = _count(hf, "n_shared_experts", 2)
    moe_width = _count(hf, "moe_intermediate_size", 1407)
    return {
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": moe_width,
        "moe_shared_expert_intermediate_size": shared * moe_width,
        "moe_router_topk": k,
        "moe_router_topk_scaling_factor": float(scaling),
        "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        # training only: the balance loss of the remote code's seq_aux / aux_loss_alpha
        "moe_router_load_balancing_type": "seq_aux_loss" if hf.get("seq_aux", True) else "aux_loss",
        "moe_aux_loss_coeff": float(alpha),
    }


_MOE_FIELDS = (
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "topk_method",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "aux_loss_alpha",
    "seq_aux",
)


def _get_mscale(factor: float, mscale: float = 1.0) -> float:
    """transformers' and Megatron-Core's YaRN ``get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_to_mcore(hf: dict) -> dict:
    """``rope_scaling`` null or YaRN as transformers' V2 classes apply it (module docstring)."""
    y = deepseek.yarn_fields(hf, 2048, "DeepseekV2Attention")
    if y is None:
        return dict(deepseek.UNSCALED_ROPE)
    factor, mscale, all_dim = y.pop("factor"), y.pop("mscale"), y.pop("mscale_all_dim")
    # transformers' attention factor; Megatron-Core's, with mscale_all_dim 0, is get_mscale(mscale)
    want = (
        _get_mscale(factor, mscale) / _get_mscale(factor, all_dim)
        if mscale and all_dim
        else _get_mscale(factor)
    )
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": factor,
        "mscale": 0.0 if factor <= 1 else (want - 1.0) / (0.1 * math.log(factor)),
        "mscale_all_dim": 0.0,
        **y,
    }


def _mla_to_mcore(hf: dict) -> dict:
    # head_dim is no field of the V2 attention: the config class sets it to qk_rope_head_dim
    return deepseek.mla_to_mcore({k: v for k, v in hf.items() if k != "head_dim"})


_REMOTE = "the remote code's switch, which transformers' DeepseekV2 classes do not read"
CONFIG = (
    Field("num_hidden_layers", "num_layers"),
    Field("hidden_size", "hidden_size"),
    Field("intermediate_size", "ffn_hidden_size", default=11008),
    Field("num_attention_heads", "num_attention_heads"),
    Field("rms_norm_eps", "layernorm_epsilon", default=1e-6),
    Field("rope_theta", "rotary_base", default=10000.0),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", default=False),
    Field("max_position_embeddings", "seq_length", default=2048),
    Field("initializer_range", "init_method_std", default=0.02),
    Field("attention_dropout", "attention_dropout", default=0.0),
    Require("hidden_act", lambda v: v == "silu", "the family's MLPs are SwiGLU (silu-gated)"),
    Require("model_type", lambda v: v == "deepseek_v2", "the HF side is DeepseekV2ForCausalLM"),
    Derived(tuple(f for f in deepseek.MLA_FIELDS if f != "head_dim"), _mla_to_mcore, lambda c: {}),
    Carry("head_dim"),  # DeepseekV2Config sets it to qk_rope_head_dim whatever the file holds
    Derived(("rope_scaling",), _rope_to_mcore, lambda c: {}),
    Derived(_MOE_FIELDS, _moe_to_mcore, lambda c: {}),
    NoOp(
        "attention_bias",
        (False,),
        "it biases q_a_proj, kv_a_proj_with_mqa and o_proj, which Megatron-Core's multi-latent "
        "attention builds without biases",
    ),
    NoOp(
        "mlp_bias", (False,), "it biases every MLP and expert, which Megatron-Core's MoE does not"
    ),
    # the remote code renormalises the top-k under it; transformers' classes never do, and are the
    # reference the gate compares with: a checkpoint meant for either reading is refused
    NoOp("norm_topk_prob", (False,), _REMOTE),
    NoOp("scoring_func", ("softmax",), _REMOTE),
    NoOp("moe_layer_freq", (1,), _REMOTE),
    Carry("ep_size"),  # the remote code's expert-parallel degree: placement, not maths
    Carry("pretraining_tp"),  # read by neither the native classes nor the remote code's forward
    Carry("output_router_logits"),
)

_L = "model.layers.*."
WEIGHTS = (
    EMBEDDING,
    # DeepSeek-V3's layer without its expert bias
    *(e for e in deepseek.LAYER_WEIGHTS if not e.mcore.endswith("router.expert_bias")),
    *FINAL_NORM_AND_HEAD,
)


def shape_context(config: DeepseekV2Core, vocab_size: int) -> deepseek.DeepseekShapeContext:
    """Shape facts of a DeepSeek-V2 config for the table (``vocab_size``: the HF, unpadded one)."""
    return deepseek.shape_context(config, vocab_size)


FAMILY = Family(
    name="deepseek-v2",
    architectures=("DeepseekV2ForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.deepseek_v2_nemo:DeepseekV2Config",
    model_cls="models.deepseek_v2_nemo:DeepseekV2Model",
    core_config_cls="models.deepseek_v2:DeepseekV2Core",
    shape_context=shape_context,
    context_symbols=("models.deepseek:deepseek_block_spec",),
    plan_shape=deepseek.plan_shape,
    summary="DeepSeek-V2-Lite and its chat and coder checkpoints: DeepSeek-V3's multi-latent "
    "attention and experts with greedy softmax routing and transformers' YaRN scales",
    variants=(
        Variant("v2_lite", "q_lora_rank null, first layer dense, 2 shared experts, YaRN 0.707"),
        Variant("q_lora", "a query latent, scaled routing, YaRN with mscale only"),
    ),
)
