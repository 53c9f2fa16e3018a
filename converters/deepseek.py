"""DeepSeek family <-> HF ``DeepseekV3ForCausalLM`` (DeepSeek-V3, Kimi K2, Moonlight): config
mapping, weight table, NeMo connectors.

Attention is multi-latent (MLA): queries through a low-rank ``q_a_proj`` / RMSNorm / ``q_b_proj``
(or one ``q_proj`` where ``q_lora_rank`` is null), keys and values from one shared latent
(``kv_a_proj_with_mqa``: ``kv_lora_rank`` latent channels plus one rotary key of
``qk_rope_head_dim`` shared by all heads), its RMSNorm and ``kv_b_proj``. Megatron-Core's
``MLASelfAttention`` has the same projections, in the same row order, so every tensor is a
rename. Its rotary path reads each rotary slice as interleaved pairs and de-interleaves it before
rotating (``rope_utils._apply_rotary_pos_emb_bshd`` with ``multi_latent_attention``), which is
what transformers does under ``rope_interleave: true`` (``apply_rotary_pos_emb_interleave``): the
published checkpoints' convention, and the only one this family converts.

The first ``first_k_dense_replace`` layers have a dense SwiGLU MLP of ``intermediate_size``; the
rest a sigmoid router over ``n_routed_experts`` experts of ``moe_intermediate_size`` with the
group-limited top-k of DeepSeek-V3 and a shared expert of ``n_shared_experts`` times that width
(Megatron's ``moe_layer_freq`` as a per-layer list). The router's ``e_score_correction_bias``
buffer is Megatron's ``expert_bias`` (the table maps it like a weight, in fp32 as Megatron
keeps it); the releases store it as F32 beside BF16 weights, so it is one of the family's
``fp32_tensors``: no vote on the import dtype, never cast, and F32 again on export. The routing
maths is in
:mod:`models.deepseek`; what the family refuses, by name, is in :func:`_moe_to_mcore`,
:func:`mla_to_mcore` and :func:`_rope_to_mcore`.

Multi-token prediction: published DeepSeek-V3 checkpoints carry ``num_nextn_predict_layers``
(one) extra layer at index ``num_hidden_layers`` (``model.layers.61.*``), which transformers'
class neither builds nor loads. It becomes Megatron-Core's MTP block (``mtp_num_layers``):
``enorm`` / ``hnorm`` / ``eh_proj`` by name, the decoder layer as ``transformer_layer``,
``shared_head.norm`` as ``final_layernorm``. The layer's own ``embed_tokens`` and
``shared_head.head`` are copies of the model's (DeepSeek-V3 shares them, and so does Megatron's
block): the import checks that they are equal, bit for bit, and export writes the copies back.
Megatron-Core concatenates ``[enorm(embedding of the next token), hnorm(hidden)]`` before
``eh_proj``, the order of DeepSeek's layout (``e`` then ``h``). The gate checks the layer's logits
(:mod:`porting.parity.mtp`) against transformers' decoder layer assembled the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from porting.contract.config_map import BOOL, Carry, Derived, Field, NoOp, Require
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import Fused, Ignore, Rename, gated_mlp
from porting.contract.rope import rope_kind, rope_number
from porting.contract.transforms import VOCAB_PAD, TransformPair, same_values
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.deepseek import DeepseekCore

# transformers' DeepseekV3Config defaults (DeepSeek-V3's values), for a config.json without them
_DEFAULTS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096,
}


def _int(hf: dict, name: str, *, null_ok: bool = False, at_least: int = 1):
    v = hf.get(name, _DEFAULTS[name])
    if v is None and null_ok:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < at_least:
        raise PortingError(f"config.json: {name} must be an integer >= {at_least}, not {v!r}")
    return v


def mla_to_mcore(hf: dict) -> dict:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        # every head has its own keys from kv_b_proj; transformers' eager attention would repeat
        # them num_attention_heads / num_key_value_heads times and fail on the shapes
        raise PortingError(
            f"config.json: num_key_value_heads={kv_heads!r} must equal num_attention_heads="
            f"{heads}: multi-latent attention gives every head its own keys"
        )
    nope, rope = _int(hf, "qk_nope_head_dim"), _int(hf, "qk_rope_head_dim")
    if rope % 2:
        raise PortingError(
            f"config.json: qk_rope_head_dim={rope} must be even (rotary embeddings turn pairs)"
        )
    # transformers' config stores both derived widths and reads them back as given
    for name, want in (("qk_head_dim", nope + rope), ("head_dim", rope)):
        if name in hf and hf[name] != want:
            raise PortingError(
                f"config.json: {name}={hf[name]!r} must be {want} (qk_nope_head_dim={nope}, "
                f"qk_rope_head_dim={rope}): transformers sizes the attention by it"
            )
    return {
        "multi_latent_attention": True,
        "q_lora_rank": _int(hf, "q_lora_rank", null_ok=True),
        "kv_lora_rank": _int(hf, "kv_lora_rank"),
        "qk_head_dim": nope,
        "qk_pos_emb_head_dim": rope,
        "v_head_dim": _int(hf, "v_head_dim"),
        "kv_channels": nope + rope,
        "num_query_groups": heads,
    }


MLA_FIELDS = (
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_head_dim",
    "head_dim",
)


# unscaled rotary; Megatron's softmax scale reads rotary_scaling_factor whatever the rope type
UNSCALED_ROPE = {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}


def yarn_fields(hf: dict, max_positions: int, attention: str) -> dict | None:
    """``rope_scaling``'s YaRN fields, each checked (None where it is null), for Megatron-Core's
    multi-latent YaRN: ``factor``, ``mscale`` and ``mscale_all_dim`` (0 where absent), the betas
    and ``original_max_position_embeddings`` (``max_positions`` where neither it nor
    ``max_position_embeddings`` is given). ``attention`` names the HF class, for the refusal of
    another rotary type."""
    rs = hf.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise PortingError(f"config.json: rope_scaling must be an object, not {rs!r}")
    kind = rope_kind(rs)
    if kind != "yarn":
        raise PortingError(
            f"config.json: rope_scaling type {kind!r} is not supported: {attention} and "
            "Megatron-Core's multi-latent attention have only plain and YaRN rotary embeddings in "
            "common"
        )
    if rs.get("attention_factor") is not None:
        raise PortingError(
            f"config.json: rope_scaling.attention_factor={rs['attention_factor']!r} is not "
            "supported: Megatron-Core's YaRN derives the factor from mscale and mscale_all_dim"
        )
    if rs.get("truncate", True) is not True:
        raise PortingError(
            f"config.json: rope_scaling.truncate={rs['truncate']!r} is not supported: "
            "Megatron-Core's multi-latent YaRN always rounds its correction range"
        )

    def optional(key: str, default, **bounds):
        return default if rs.get(key) is None else rope_number(rs, key, **bounds)

    beta_fast = optional("beta_fast", 32.0, above=0) or 32.0
    beta_slow = optional("beta_slow", 1.0, above=0) or 1.0
    if beta_fast < beta_slow:
        raise PortingError(
            f"config.json: rope_scaling.beta_fast ({beta_fast!r}) must not be below beta_slow "
            f"({beta_slow!r})"
        )
    original = optional("original_max_position_embeddings", None, at_least=1, integer=True)
    return {
        "factor": float(rope_number(rs, "factor", at_least=1)),
        "mscale": float(optional("mscale", 0.0, at_least=0)),
        "mscale_all_dim": float(optional("mscale_all_dim", 0.0, at_least=0)),
        "beta_fast": float(beta_fast),
        "beta_slow": float(beta_slow),
        "original_max_position_embeddings": original
        or hf.get("max_position_embeddings", max_positions),
    }


def _rope_to_mcore(hf: dict) -> dict:
    """``rope_scaling`` null or YaRN into Megatron-Core's MLA rotary (``rope_type``).

    transformers multiplies cos and sin by YaRN's attention factor (``mscale / mscale_all_dim``
    through ``get_mscale`` where both are set, else ``get_mscale(factor)``) and the scores by
    ``get_mscale(factor, mscale_all_dim) ** 2 / sqrt(qk_head_dim)``; Megatron's
    ``YarnRotaryEmbedding`` and ``MultiLatentAttention`` compute the same two numbers from
    ``mscale`` and ``mscale_all_dim`` (``_yarn_get_concentration_factor``, ``_yarn_get_mscale``).
    Values where the two readings part are refused by name.
    """
    # DeepseekV3Attention reads rope_scaling['factor'] for its softmax scale whatever the type
    y = yarn_fields(hf, _DEFAULTS["max_position_embeddings"], "DeepseekV3Attention")
    if y is None:
        return dict(UNSCALED_ROPE)
    mscale, all_dim = y.pop("mscale"), y["mscale_all_dim"]
    if all_dim and not mscale:
        # transformers then scales cos/sin by get_mscale(factor) but the scores by
        # get_mscale(factor, mscale_all_dim)**2; Megatron divides the former by the latter's root
        raise PortingError(
            f"config.json: rope_scaling.mscale_all_dim={all_dim!r} without mscale is not "
            "supported: Megatron-Core's YaRN would divide the rotary scale by it"
        )
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": y.pop("factor"),
        # transformers reads mscale only beside mscale_all_dim (else get_mscale(factor): 1.0)
        "mscale": mscale if all_dim else 1.0,
        **y,
    }


_MOE_FIELDS = (
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "first_k_dense_replace",
    "aux_loss_alpha",
    "seq_aux",
)


def _moe_to_mcore(hf: dict) -> dict:
    """DeepseekV3TopkRouter's routing as Megatron's ``topk_routing_with_score_function`` with a
    sigmoid score, the expert bias, group-limited top-k and the scaling factor."""
    layers = hf["num_hidden_layers"]
    experts, k = _int(hf, "n_routed_experts"), hf.get("num_experts_per_tok", 8)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= experts:
        raise PortingError(
            f"config.json: num_experts_per_tok={k!r} must be an integer from 1 to "
            f"n_routed_experts={experts}"
        )
    if hf.get("norm_topk_prob", True) is not True:
        raise PortingError(
            f"config.json: norm_topk_prob={hf['norm_topk_prob']!r} is not supported: "
            "Megatron-Core's sigmoid router always renormalises the top-k scores"
        )
    if k == 1:
        raise PortingError(
            "config.json: num_experts_per_tok=1 is not supported: transformers renormalises a "
            "single sigmoid score to 1, and Megatron-Core's router keeps it as it is"
        )
    groups, topk_group = _int(hf, "n_group"), _int(hf, "topk_group")
    if experts % groups or topk_group > groups:
        raise PortingError(
            f"config.json: n_group={groups} must divide n_routed_experts={experts} and be at "
            f"least topk_group={topk_group}"
        )
    if groups > 1 and (experts // groups < 2 or k // topk_group != 2):
        # transformers scores a group by its two best experts; Megatron-Core by its best
        # num_experts_per_tok // topk_group
        raise PortingError(
            f"config.json: n_group={groups} with topk_group={topk_group} and "
            f"num_experts_per_tok={k} is not supported: transformers scores each group by its "
            f"top 2 experts, Megatron-Core by its top {k // topk_group}"
        )
    dense = _int(hf, "first_k_dense_replace", at_least=0)
    if dense > layers:
        raise PortingError(
            f"config.json: first_k_dense_replace={dense} must be at most num_hidden_layers={layers}"
        )
    shared = _int(hf, "n_shared_experts")
    scaling = hf.get("routed_scaling_factor", _DEFAULTS["routed_scaling_factor"])
    if not isinstance(scaling, int | float) or isinstance(scaling, bool) or not scaling > 0:
        raise PortingError(
            f"config.json: routed_scaling_factor must be a finite number > 0, not {scaling!r}"
        )
    alpha = hf.get("aux_loss_alpha", 0.001)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha < 0:
        raise PortingError(f"config.json: aux_loss_alpha must be a number >= 0, not {alpha!r}")
    if not isinstance(hf.get("seq_aux", True), bool):
        raise PortingError(f"config.json: seq_aux must be true or false, not {hf['seq_aux']!r}")
    moe_width = _int(hf, "moe_intermediate_size")
    return {
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": moe_width,
        "moe_shared_expert_intermediate_size": shared * moe_width,
        "moe_router_topk": k,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": topk_group if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(scaling),
        "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        # training only: the balance loss of the remote code's seq_aux / aux_loss_alpha
        "moe_router_load_balancing_type": "seq_aux_loss" if hf.get("seq_aux", True) else "aux_loss",
        "moe_aux_loss_coeff": float(alpha),
    }


def _mtp_to_mcore(hf: dict) -> dict:
    n = hf.get("num_nextn_predict_layers", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise PortingError(
            f"config.json: num_nextn_predict_layers must be an integer >= 0, not {n!r}"
        )
    if not n:
        return {"mtp_num_layers": None}
    layers = hf["num_hidden_layers"]
    if n > 1:
        # each layer would carry its own copies of the embedding and head: no release has them
        raise PortingError(
            f"config.json: num_nextn_predict_layers={n} is not supported: this family converts "
            "one multi-token-prediction layer (DeepSeek-V3's), whose embedding and head copies "
            "it checks against the model's"
        )
    if hf.get("tie_word_embeddings", False):
        raise PortingError(
            "config.json: num_nextn_predict_layers with tie_word_embeddings=true is not "
            "supported: the layer's shared_head.head copies an untied lm_head"
        )
    if hf.get("first_k_dense_replace", _DEFAULTS["first_k_dense_replace"]) >= layers:
        # transformers would make layer num_hidden_layers a mixture of experts; Megatron-Core
        # builds the MTP layer as the decoder's last, which is dense
        raise PortingError(
            f"config.json: num_nextn_predict_layers={n} needs the last decoder layer to be a "
            f"mixture of experts, as the prediction layer is (first_k_dense_replace="
            f"{hf.get('first_k_dense_replace')} makes all {layers} dense)"
        )
    # DeepSeek-V3's weight of the prediction loss for its last 4.8T tokens (arXiv 2412.19437,
    # section 4.2); training only
    return {"mtp_num_layers": n, "mtp_loss_scaling_factor": 0.1}


def _mtp_note(hf: dict) -> str | None:
    n = hf.get("num_nextn_predict_layers")
    if not n:
        return None
    last = hf["num_hidden_layers"]
    return (
        f"config.json: num_nextn_predict_layers={n}: the multi-token-prediction layer "
        f"(model.layers.{last}.*, which transformers' model does not run) becomes Megatron-Core's "
        "MTP block (mtp.layers.0.*), and the gate compares its logits too"
    )


_REMOTE = "the remote code's switch, which transformers' DeepseekV3 class hard-codes to this value"
CONFIG = (
    Field("num_hidden_layers", "num_layers"),
    Field("hidden_size", "hidden_size"),
    Field("intermediate_size", "ffn_hidden_size"),
    Field("num_attention_heads", "num_attention_heads"),
    Field("rms_norm_eps", "layernorm_epsilon"),
    Field("rope_theta", "rotary_base", default=10000.0),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", default=False),
    Field("max_position_embeddings", "seq_length"),
    Field("initializer_range", "init_method_std", default=0.02),
    Field("attention_dropout", "attention_dropout", default=0.0),
    Require("hidden_act", lambda v: v == "silu", "the family's MLPs are SwiGLU (silu-gated)"),
    Require(
        "model_type",
        lambda v: v in ("deepseek_v3", "kimi_k2"),
        "the HF side is DeepseekV3ForCausalLM (deepseek_v3; Kimi K2's configs say kimi_k2)",
    ),
    Derived(MLA_FIELDS, mla_to_mcore, lambda c: {}),
    Derived(("rope_scaling",), _rope_to_mcore, lambda c: {}),
    Derived(_MOE_FIELDS, _moe_to_mcore, lambda c: {}),
    NoOp(
        "rope_interleave",
        (True,),
        "Megatron-Core's multi-latent attention de-interleaves the rotary slice as transformers "
        "does under rope_interleave=true; plain halves would need the rotary rows permuted",
    ),
    NoOp(
        "attention_bias",
        (False,),
        "it biases q_a_proj, kv_a_proj_with_mqa and o_proj, which Megatron-Core's multi-latent "
        "attention builds without biases",
    ),
    # the remote code (auto_map) reads these; transformers' native class implements only the
    # values carried here, and is the reference the gate compares with
    NoOp("scoring_func", ("sigmoid",), _REMOTE),
    NoOp("topk_method", ("noaux_tc",), _REMOTE),
    NoOp("moe_layer_freq", (1,), _REMOTE),
    Carry("ep_size"),  # the remote code's expert-parallel degree: placement, not maths
    Carry("pretraining_tp"),  # read by neither the native class nor the remote code's forward
    Derived(
        ("num_nextn_predict_layers",),
        _mtp_to_mcore,
        lambda c: {"num_nextn_predict_layers": c.mtp_num_layers} if c.mtp_num_layers else {},
        note=_mtp_note,
    ),
    Carry("output_router_logits", check=BOOL),
)


@dataclass(frozen=True)
class DeepseekShapeContext(ShapeContext):
    """Adds what the table's ``when`` and ``layers`` predicates read."""

    num_experts: int = 0
    first_dense: int = 0
    q_lora: bool = True


_L = "model.layers.*."
_M = "decoder.layers.*."
_A, _SA = _L + "self_attn.", _M + "self_attention."
_EXPERT = _M + "mlp.experts.local_experts.#."


def _dense(c: DeepseekShapeContext, layer: int) -> bool:
    return layer < c.first_dense


def _sparse(c: DeepseekShapeContext, layer: int) -> bool:
    return layer >= c.first_dense


def _q_lora(c: DeepseekShapeContext) -> bool:
    return c.q_lora


def _mtp(c: DeepseekShapeContext) -> bool:
    return c.mtp_layers > 0


def _same(main, copy, where: str):
    if main.shape != copy.shape or (main.device.type != "meta" and not same_values(main, copy)):
        raise PortingError(
            f"the multi-token-prediction layer's {where} differs from the model's; Megatron-Core's "
            "MTP block shares the model's, so a different copy cannot be kept"
        )
    return main


def _shared(where: str) -> TransformPair:
    """The model's tensor and the MTP layer's copy of it into one padded Megatron tensor; export
    writes the copy back (the same tensor under both names: the writer only reads it, and a
    clone of a 129,280-row table is 1.9 GB more at the export's peak)."""
    return TransformPair(
        f"mtp_shared_{where}",
        lambda main, copy, ctx: VOCAB_PAD.forward(_same(main, copy, where), ctx),
        lambda t, ctx: (lambda hf: (hf, hf))(VOCAB_PAD.inverse(t, ctx)[0]),
    )


# Megatron-Core keeps the expert bias in fp32 whatever the weights' dtype (TopKRouter's
# _maintain_float32_expert_bias); export writes it back in the dtype the source stored it in
TO_FP32 = TransformPair("to_fp32", lambda t, ctx: t.float(), lambda t, ctx: (t,))


LAYER_WEIGHTS = (
    Rename(_L + "input_layernorm.weight", _M + "input_layernorm.weight"),
    Rename(_A + "q_a_proj.weight", _SA + "linear_q_down_proj.weight", when=_q_lora),
    Rename(_A + "q_a_layernorm.weight", _SA + "q_layernorm.weight", when=_q_lora),
    Rename(_A + "q_b_proj.weight", _SA + "linear_q_up_proj.weight", when=_q_lora),
    Rename(_A + "q_proj.weight", _SA + "linear_q_proj.weight", when=lambda c: not c.q_lora),
    Rename(_A + "kv_a_proj_with_mqa.weight", _SA + "linear_kv_down_proj.weight"),
    Rename(_A + "kv_a_layernorm.weight", _SA + "kv_layernorm.weight"),
    Rename(_A + "kv_b_proj.weight", _SA + "linear_kv_up_proj.weight"),
    Rename(_A + "o_proj.weight", _SA + "linear_proj.weight"),
    Rename(_L + "post_attention_layernorm.weight", _M + "pre_mlp_layernorm.weight"),
    *gated_mlp(_L + "mlp.", _M + "mlp.", layers=_dense),
    Rename(_L + "mlp.gate.weight", _M + "mlp.router.weight", layers=_sparse),
    Fused(
        (_L + "mlp.gate.e_score_correction_bias",),
        _M + "mlp.router.expert_bias",
        TO_FP32,
        layers=_sparse,
    ),
    *gated_mlp(_L + "mlp.experts.#.", _EXPERT, layers=_sparse),
    *gated_mlp(_L + "mlp.shared_experts.", _M + "mlp.shared_experts.", layers=_sparse),
)


def _as_mtp(entry: Rename | Fused) -> Rename | Fused:
    """A decoder layer's entry as the MTP layer's (``model.layers.@.`` -> its
    ``transformer_layer``), which is a mixture-of-experts layer."""

    def move(name: str) -> str:
        return name.replace(_L, _H).replace(_M, _T + "transformer_layer.")

    def when(c, own=entry.when) -> bool:
        return _mtp(c) and (own is None or own(c))

    if isinstance(entry, Rename):
        return Rename(move(entry.hf), move(entry.mcore), when=when)
    return Fused(tuple(map(move, entry.hf)), move(entry.mcore), entry.transform, when=when)


_H, _T = "model.layers.@.", "mtp.layers.@."
WEIGHTS = (
    Fused(
        ("model.embed_tokens.weight",),
        "embedding.word_embeddings.weight",
        VOCAB_PAD,
        when=lambda c: not _mtp(c),
    ),
    Fused(
        ("model.embed_tokens.weight", _H + "embed_tokens.weight"),
        "embedding.word_embeddings.weight",
        _shared("embed_tokens"),
        when=_mtp,
    ),
    *LAYER_WEIGHTS,
    Rename("model.norm.weight", "decoder.final_layernorm.weight"),
    Fused(
        ("lm_head.weight",),
        "output_layer.weight",
        VOCAB_PAD,
        when=lambda c: not c.tied_output and not _mtp(c),
    ),
    Fused(
        ("lm_head.weight", _H + "shared_head.head.weight"),
        "output_layer.weight",
        _shared("shared_head.head"),
        when=_mtp,  # with an untied head only (the config lint)
    ),
    Ignore(
        "lm_head.weight",
        "tied to model.embed_tokens.weight; transformers ignores it too",
        when=lambda c: c.tied_output,
    ),
    Rename(_H + "enorm.weight", _T + "enorm.weight", when=_mtp),
    Rename(_H + "hnorm.weight", _T + "hnorm.weight", when=_mtp),
    Rename(_H + "eh_proj.weight", _T + "eh_proj.weight", when=_mtp),
    *(_as_mtp(e) for e in LAYER_WEIGHTS if e.layers is not _dense),
    Rename(_H + "shared_head.norm.weight", _T + "final_layernorm.weight", when=_mtp),
)


def shape_context(config: DeepseekCore, vocab_size: int) -> DeepseekShapeContext:
    """Shape facts of a DeepSeek config for the table (``vocab_size`` is the HF, unpadded one)."""
    return DeepseekShapeContext.from_config(
        config,
        vocab_size,
        num_experts=config.num_moe_experts,
        first_dense=list(config.moe_layer_freq).count(0),
        q_lora=config.q_lora_rank is not None,
    )


def plan_shape(cfg: dict, source: str, read) -> dict:
    """What the planner needs (``Family.plan_shape``; ``read``: its readers): the Llama layout's
    reading, experts included, with multi-head latent attention's ranks and head widths."""
    return read.llama_layout(cfg, source) | read.mla_fields(cfg, source)


FAMILY = Family(
    name="deepseek",
    architectures=("DeepseekV3ForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.deepseek_nemo:DeepseekConfig",
    model_cls="models.deepseek_nemo:DeepseekModel",
    core_config_cls="models.deepseek:DeepseekCore",
    shape_context=shape_context,
    context_symbols=("models.deepseek:deepseek_block_spec",),
    # DeepSeek-V3's and Kimi K2's safetensors hold it as F32 beside BF16 (and FP8) weights
    fp32_tensors=(_L + "mlp.gate.e_score_correction_bias",),
    summary="multi-latent attention and sigmoid-routed experts on Megatron-Core's MLA and MoE "
    "layers: DeepSeek-V3, Kimi K2, Moonlight (first layers dense, group-limited top-k, expert "
    "bias, shared expert, YaRN)",
    variants=(
        Variant("v3", "q and kv LoRA ranks, first layer dense, 2 expert groups, shared expert"),
        Variant("q_full", "q_lora_rank null: one q_proj (DeepSeek-V2-Lite / Moonlight layout)"),
        Variant("yarn", "YaRN rotary with mscale / mscale_all_dim (DeepSeek-V3, Kimi K2)"),
    ),
    mtp_count="num_nextn_predict_layers",
    plan_shape=plan_shape,
)
