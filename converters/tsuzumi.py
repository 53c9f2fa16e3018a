"""tsuzumi-style family <-> HF ``LlamaForCausalLM``: config mapping, weight table, NeMo connectors.

The HF side uses the Llama checkpoint layout, so parity is checked against the third-party
``transformers`` Llama implementation. Layout facts (see also ``porting/convert/transforms.py``):

- HF keeps ``q_proj``, ``k_proj``, ``v_proj`` apart; Megatron fuses them per query group.
- HF ``rotate_half`` rotary and Megatron's non-interleaved rotary are the same convention
  (``transformers/models/llama/modeling_llama.py`` vs
  ``megatron/core/models/common/embeddings/rope_utils.py``), so no q/k row permutation is needed.
- HF ``gate_proj``/``up_proj`` stack into Megatron's gated ``linear_fc1``.
"""

from __future__ import annotations

import math

from models.tsuzumi import TsuzumiConfig, TsuzumiModel
from porting.convert.config_map import Carry, Derived, Field, Require
from porting.convert.connectors import register_connectors
from porting.convert.mapping import Fused, Ignore, Rename
from porting.convert.transforms import GATED_MLP, QKV, VOCAB_PAD
from porting.errors import PortingError
from porting.family import Family, ShapeContext, Variant


def _query_groups_to_mcore(hf: dict) -> dict:
    # that the KV heads divide the heads is the shared rule's (config_map.RELATIONS)
    return {"num_query_groups": hf.get("num_key_value_heads") or hf["num_attention_heads"]}


def _biases_to_mcore(hf: dict) -> dict:
    attention, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention != mlp:
        # Megatron's add_bias_linear puts biases on all four linears at once; add_qkv_bias covers
        # q/k/v only, but HF attention_bias also biases o_proj. No Megatron switch matches either mix.
        raise PortingError(
            f"config.json: attention_bias={attention} with mlp_bias={mlp} is not supported: "
            "Megatron biases either all linear layers (add_bias_linear) or none"
        )
    return {"add_bias_linear": attention}


def _biases_to_hf(c) -> dict:
    return {"attention_bias": c.add_bias_linear, "mlp_bias": c.add_bias_linear}


_ROPE_KEYS = {
    "rope_type",
    "type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
}


def _rope_number(rs: dict, key: str, *, at_least: float | None = None, integer: bool = False):
    """``rope_scaling[key]`` as transformers' ``rope_config_validation`` requires it (present, a
    finite number, an integer where it must be, ``factor >= 1``), or one line naming it: a factor
    of 0 divided by zero inside Megatron's rotary embedding, a negative one converted silently."""
    v = rs.get(key)
    ok = (
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and (not integer or isinstance(v, int))
        and (at_least is None or v >= at_least)
    )
    if not ok:
        kind = "an integer" if integer else "a finite number"
        bound = f" >= {at_least:g}" if at_least is not None else ""
        raise PortingError(f"config.json: rope_scaling.{key} must be {kind}{bound}, not {v!r}")
    return v


def _rope_to_mcore(hf: dict) -> dict:
    rs = hf.get("rope_scaling")
    if rs is None:
        return {"rope_scaling_type": None}
    if not isinstance(rs, dict):
        raise PortingError(f"config.json: rope_scaling must be an object, not {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    unknown = set(rs) - _ROPE_KEYS
    if kind == "default":
        return {"rope_scaling_type": None}
    if kind == "linear" and not unknown - {"rope_type", "type", "factor"}:
        # HF divides inv_freq by the factor; Megatron divides positions by it: the same angles.
        factor = _rope_number(rs, "factor", at_least=1)
        return {"rope_scaling_type": "linear", "seq_len_interpolation_factor": float(factor)}
    if kind == "llama3" and not unknown:
        low = _rope_number(rs, "low_freq_factor", at_least=0)
        high = _rope_number(rs, "high_freq_factor", at_least=0)
        if not low < high:
            # transformers' llama3 rule divides by (high - low)
            raise PortingError(
                f"config.json: rope_scaling.low_freq_factor ({low!r}) must be below "
                f"high_freq_factor ({high!r})"
            )
        return {
            "rope_scaling_type": "llama3",
            "rope_scaling_factor": float(_rope_number(rs, "factor", at_least=1)),
            "rope_scaling_low_freq_factor": float(low),
            "rope_scaling_high_freq_factor": float(high),
            "rope_scaling_original_max_position_embeddings": _rope_number(
                rs, "original_max_position_embeddings", at_least=1, integer=True
            ),
        }
    raise PortingError(
        f"config.json: rope_scaling={rs!r} is not supported (supported: none, 'linear', 'llama3')"
    )


def _rope_to_hf(c) -> dict:
    # The original rope_scaling object is carried verbatim by config_map.to_hf; nothing to re-derive
    # beyond confirming the type survived.
    return {}


QUERY_GROUPS = Derived(
    ("num_key_value_heads",),  # null: transformers uses num_attention_heads
    _query_groups_to_mcore,
    lambda c: {"num_key_value_heads": c.num_query_groups},
)
ROPE_SCALING = Derived(("rope_scaling",), _rope_to_mcore, _rope_to_hf)
# For configs that may leave head_dim out or null (hidden/heads then): the original value is
# carried back on export as it was, never replaced by the derived one.
HEAD_DIM_OR_NULL = Derived(
    ("head_dim",), lambda hf: {"kv_channels": hf.get("head_dim")}, lambda c: {}
)

# The fields every Llama-layout config shares (Llama, Mistral, Qwen2/3): families built on this
# layout start from these and add their own. Each value's type and range is the rule every family
# shares for that field (config_map.FIELD_RULES).
LLAMA_LAYOUT = (
    Field("num_hidden_layers", "num_layers"),
    Field("hidden_size", "hidden_size"),
    Field("intermediate_size", "ffn_hidden_size"),
    Field("num_attention_heads", "num_attention_heads"),
    QUERY_GROUPS,
    Field("rms_norm_eps", "layernorm_epsilon"),
    Field("rope_theta", "rotary_base", default=10000.0),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", default=False),
    Field("max_position_embeddings", "seq_length"),
    Field("initializer_range", "init_method_std", default=0.02),
    Field("attention_dropout", "attention_dropout", default=0.0),
    Require("hidden_act", lambda v: v == "silu", "the family's MLP is SwiGLU (silu-gated)"),
    Carry("architectures"),
    # padded on the Megatron side by the engine, restored exactly on export
    Carry("vocab_size"),
    Carry("bos_token_id"),
    Carry("eos_token_id"),
    Carry("pad_token_id"),
    Carry("torch_dtype"),
    Carry("dtype"),
    Carry("transformers_version"),
    Carry("use_cache"),
)

CONFIG = (
    *LLAMA_LAYOUT,
    Field("head_dim", "kv_channels", default=None),
    Derived(("attention_bias", "mlp_bias"), _biases_to_mcore, _biases_to_hf),
    ROPE_SCALING,
    Require(
        "pretraining_tp",
        lambda v: v == 1 and not isinstance(v, bool),
        "sliced-matmul emulation is not modelled",
    ),
    Require("model_type", lambda v: v == "llama", "the HF side is the Llama layout"),
)

_L = "model.layers.*."
_M = "decoder.layers.*."


def _biased(ctx: ShapeContext) -> bool:
    return ctx.attention_bias


WEIGHTS = (
    Fused(("model.embed_tokens.weight",), "embedding.word_embeddings.weight", VOCAB_PAD),
    Rename(_L + "input_layernorm.weight", _M + "input_layernorm.weight"),
    Fused(
        (
            _L + "self_attn.q_proj.weight",
            _L + "self_attn.k_proj.weight",
            _L + "self_attn.v_proj.weight",
        ),
        _M + "self_attention.linear_qkv.weight",
        QKV,
    ),
    Fused(
        (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
        _M + "self_attention.linear_qkv.bias",
        QKV,
        when=_biased,
    ),
    Rename(_L + "self_attn.o_proj.weight", _M + "self_attention.linear_proj.weight"),
    Rename(_L + "self_attn.o_proj.bias", _M + "self_attention.linear_proj.bias", when=_biased),
    Rename(_L + "post_attention_layernorm.weight", _M + "pre_mlp_layernorm.weight"),
    Fused(
        (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
        _M + "mlp.linear_fc1.weight",
        GATED_MLP,
    ),
    Fused(
        (_L + "mlp.gate_proj.bias", _L + "mlp.up_proj.bias"),
        _M + "mlp.linear_fc1.bias",
        GATED_MLP,
        when=_biased,
    ),
    Rename(_L + "mlp.down_proj.weight", _M + "mlp.linear_fc2.weight"),
    Rename(_L + "mlp.down_proj.bias", _M + "mlp.linear_fc2.bias", when=_biased),
    Rename("model.norm.weight", "decoder.final_layernorm.weight"),
    Fused(("lm_head.weight",), "output_layer.weight", VOCAB_PAD, when=lambda c: not c.tied_output),
    Ignore(
        "lm_head.weight",
        "tied to model.embed_tokens.weight; transformers ignores it too",
        when=lambda c: c.tied_output,
    ),
    Ignore(_L + "self_attn.rotary_emb.inv_freq", "a buffer recomputed from rope_theta"),
)


def shape_context(config: TsuzumiConfig, vocab_size: int) -> ShapeContext:
    """Shape facts of a tsuzumi config for the transforms (``vocab_size`` is the HF, unpadded one)."""
    return ShapeContext.from_config(
        config, vocab_size, attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear
    )


FAMILY = Family(
    name="tsuzumi",
    architectures=("LlamaForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls=TsuzumiConfig,
    model_cls=TsuzumiModel,
    shape_context=shape_context,
    summary="Llama-family decoder on the stock GPT spec (config knobs only)",
    variants=(
        Variant("gqa_untied", "GQA, untied output"),
        Variant("tied", "tied output"),
        Variant("biases", "attention_bias and mlp_bias (every linear biased)"),
        Variant("head_dim", "head_dim apart from hidden/heads"),
        Variant("rope_scaling", "linear or llama3 rotary scaling"),
    ),
)


HFTsuzumiImporter, HFTsuzumiExporter = register_connectors(FAMILY)
