"""The Llama family <-> HF ``LlamaForCausalLM``: the Llama layout's config entries and weight table,
which the families built on it (tsuzumi, Mistral, Qwen, MoE, Gemma, a scaffold) start from.

The HF side uses the Llama checkpoint layout, so parity is checked against the third-party
``transformers`` Llama implementation. Layout facts (see also ``porting/contract/transforms.py``):

- HF keeps ``q_proj``, ``k_proj``, ``v_proj`` apart; Megatron fuses them per query group.
- HF ``rotate_half`` rotary and Megatron's non-interleaved rotary are the same convention
  (``transformers/models/llama/modeling_llama.py`` vs
  ``megatron/core/models/common/embeddings/rope_utils.py``), so no q/k row permutation is needed.
- HF ``gate_proj``/``up_proj`` stack into Megatron's gated ``linear_fc1``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from porting.contract.config_map import BOOL, POSITIVE_INT, Carry, Derived, Field, NoOp, Require
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import (
    EMBEDDING,
    FINAL_NORM_AND_HEAD,
    Fused,
    Ignore,
    Rename,
    attention,
)
from porting.contract.rope import rope_kind, rope_number
from porting.contract.transforms import GATED_MLP
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.llama import LlamaCore


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


SLIDING, FULL = "sliding_attention", "full_attention"


def check_model_type(hf: dict, expected: dict[str, str]) -> str:
    """The config's ``model_type``, which must be the one transformers pairs with its
    architecture (``expected``: architecture -> model_type)."""
    arch, mtype = hf["architectures"][0], hf.get("model_type")
    if expected.get(arch) != mtype:
        raise PortingError(
            f"config.json: model_type={mtype!r} does not match architecture {arch!r} "
            f"(expected {expected.get(arch)!r})"
        )
    return mtype


def layer_windows(
    hf: dict, types: list[str], default_window: int | None
) -> tuple[tuple[int, int] | None, list[int]]:
    """HF's per-layer attention kinds (``layer_types``) and ``sliding_window`` as Megatron's
    ``window_size`` and ``window_attn_skip_freq`` (1 on each sliding layer). HF's window ``W``
    admits keys ``i-W+1 .. i``: Megatron's ``(W-1, 0)`` (see models.mistral); ``None`` where no
    layer slides. ``default_window``: the HF config class's value where the key is absent."""
    n = hf["num_hidden_layers"]
    if set(types) - {SLIDING, FULL}:
        raise PortingError(
            f"config.json: layer_types={types!r} must name full_attention or sliding_attention "
            f"for each of the {n} layers"
        )
    window = hf.get("sliding_window", default_window)
    pattern = [int(t == SLIDING) for t in types]
    if any(pattern) and window is None:
        raise PortingError("config.json: layer_types has sliding layers but sliding_window is null")
    return ((window - 1, 0) if any(pattern) else None), pattern


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    # transformers' get_mscale in _compute_yarn_parameters: the YaRN paper's 0.1 ln(s) + 1
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_to_mcore(rs: dict, hf: dict) -> dict:
    """YaRN's keys, read as transformers' ``_compute_yarn_parameters`` reads them (null or absent
    takes its default), into the config fields :func:`models.llama.yarn_inv_freq` and
    :func:`models.llama.yarn_softmax_scale` use."""

    def optional(key: str, **bounds):
        return None if rs.get(key) is None else rope_number(rs, key, **bounds)

    factor = rope_number(rs, "factor", at_least=1)
    original = optional("original_max_position_embeddings", at_least=1, integer=True)
    # beta 0 would be a log of infinity; transformers' validation warns below beta_fast > beta_slow
    beta_fast = optional("beta_fast", above=0) or 32
    beta_slow = optional("beta_slow", above=0) or 1
    if beta_fast < beta_slow:
        raise PortingError(
            f"config.json: rope_scaling.beta_fast ({beta_fast!r}) must not be below beta_slow "
            f"({beta_slow!r})"
        )
    truncate = rs.get("truncate", True)
    if not isinstance(truncate, bool):
        raise PortingError(
            f"config.json: rope_scaling.truncate must be true or false, not {truncate!r}"
        )
    attention = optional("attention_factor", above=0)
    if attention is None:
        mscale, all_dim = optional("mscale"), optional("mscale_all_dim")
        # transformers takes the ratio only when both are set and non-zero
        if mscale and all_dim:
            top, bottom = _yarn_mscale(factor, mscale), _yarn_mscale(factor, all_dim)
            attention = top / bottom if bottom else math.inf
        else:
            attention = _yarn_mscale(factor)
        if not (math.isfinite(attention) and attention > 0):
            raise PortingError(
                f"config.json: rope_scaling.mscale ({mscale!r}) and mscale_all_dim ({all_dim!r}) "
                f"give an attention factor of {attention!r}; it must be a finite number > 0"
            )
    return {
        "rope_scaling_type": "yarn",
        "rope_scaling_factor": float(factor),
        "rope_scaling_original_max_position_embeddings": original or hf["max_position_embeddings"],
        "rope_scaling_beta_fast": float(beta_fast),
        "rope_scaling_beta_slow": float(beta_slow),
        "rope_scaling_truncate": truncate,
        "rope_scaling_attention_factor": float(attention),
    }


def _rope_to_mcore(hf: dict) -> dict:
    """``rope_scaling`` (null, or an object naming its type) to Megatron's rotary settings.

    Every supported type changes the frequency table itself, the same for every length, so the
    gate's prompts see it at every position past the first, however short they are: linear
    divides every frequency by the factor; llama3 changes those whose wavelength passes
    original_max_position_embeddings / high_freq_factor (a tiny 16-wide head's two longest at the
    published 8192 and rope_theta 1e4); YaRN interpolates every channel pair past its correction
    range's low end, and its attention factor scales every score. tests/test_rope.py's negative
    control shows a tiny model's logits move far past the tolerance without the scaling.
    """
    rs = hf.get("rope_scaling")
    if rs is None:
        return {"rope_scaling_type": None}
    if not isinstance(rs, dict):
        raise PortingError(f"config.json: rope_scaling must be an object, not {rs!r}")
    kind = rope_kind(rs)
    if kind == "default":
        return {"rope_scaling_type": None}
    if kind == "linear":
        # HF divides inv_freq by the factor; Megatron divides positions by it: the same angles.
        factor = rope_number(rs, "factor", at_least=1)
        return {"rope_scaling_type": "linear", "seq_len_interpolation_factor": float(factor)}
    if kind == "yarn":
        return _yarn_to_mcore(rs, hf)
    low = rope_number(rs, "low_freq_factor", at_least=0)
    high = rope_number(rs, "high_freq_factor", at_least=0)
    if not low < high:
        # transformers' llama3 rule divides by (high - low)
        raise PortingError(
            f"config.json: rope_scaling.low_freq_factor ({low!r}) must be below "
            f"high_freq_factor ({high!r})"
        )
    return {
        "rope_scaling_type": "llama3",
        "rope_scaling_factor": float(rope_number(rs, "factor", at_least=1)),
        "rope_scaling_low_freq_factor": float(low),
        "rope_scaling_high_freq_factor": float(high),
        "rope_scaling_original_max_position_embeddings": rope_number(
            rs, "original_max_position_embeddings", at_least=1, integer=True
        ),
    }


def _rope_to_hf(c) -> dict:
    # The original rope_scaling object is carried verbatim by config_map.to_hf (no key added or
    # re-derived): what was read is what is written back.
    return {}


# attention_bias and mlp_bias together: Megatron's one add_bias_linear, or refused
BIASES = Derived(("attention_bias", "mlp_bias"), _biases_to_mcore, _biases_to_hf)
QUERY_GROUPS = Derived(
    ("num_key_value_heads",),  # null: transformers uses num_attention_heads
    _query_groups_to_mcore,
    lambda c: {"num_key_value_heads": c.num_query_groups},
)
ROPE_SCALING = Derived(("rope_scaling",), _rope_to_mcore, _rope_to_hf)
# transformers' Llama-layout classes (Llama, Mistral, Qwen2/3, their MoE; Gemma too) shorten their
# frequency table to partial_rotary_factor (modeling_rope_utils) but apply_rotary_pos_emb multiplies
# the whole head by cos/sin, which then fails on the shapes: below 1 no such checkpoint runs there.
PARTIAL_ROTARY = NoOp(
    "partial_rotary_factor",
    (1.0,),
    "transformers' Llama-layout attention rotates the whole head (a factor below 1 shortens only "
    "its frequency table, and its forward then fails), so there is no model to convert",
)


def rotary_free_every_nth(hf: dict) -> list[int]:
    """Per layer, 1 where it rotates q and k, every ``no_rope_layer_interval``-th layer (4 where
    absent) rotary-free: the list SmolLM3's and Llama 4's config classes derive where the config
    gives none."""
    interval = hf.get("no_rope_layer_interval", 4)
    if not POSITIVE_INT.ok(interval):
        raise PortingError(
            f"config.json: no_rope_layer_interval={interval!r} must be a positive integer"
        )
    return [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])]


# For configs that may leave head_dim out or null (hidden/heads then): the original value is
# carried back on export as it was, never replaced by the derived one.
HEAD_DIM_OR_NULL = Derived(
    ("head_dim",), lambda hf: {"kv_channels": hf.get("head_dim")}, lambda c: {}
)


def head_dim_read_by(attention: str) -> Derived:
    """``head_dim`` for an attention class that reads ``getattr(config, "head_dim", hidden_size //
    heads)`` (``attention``, for the message): absent is hidden/heads, a null fails there and is
    refused here; carried back on export as it was."""

    def to_mcore(hf: dict) -> dict:
        if "head_dim" in hf and hf["head_dim"] is None:
            raise PortingError(
                f"config.json: head_dim=None is not supported: transformers' {attention} reads it "
                "as given and fails on null (leave it out for hidden_size / num_attention_heads)"
            )
        return {"kv_channels": hf.get("head_dim")}

    return Derived(("head_dim",), to_mcore, lambda c: {})


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
    PARTIAL_ROTARY,
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", default=False),
    Field("max_position_embeddings", "seq_length"),
    Field("initializer_range", "init_method_std", default=0.02),
    Field("attention_dropout", "attention_dropout", default=0.0),
    Require("hidden_act", lambda v: v == "silu", "the family's MLP is SwiGLU (silu-gated)"),
    # nanotron's leftovers (SmolLM2): a flag naming the config's kind, and its rotary convention,
    # which transformers' Llama-layout classes never read
    Carry("is_llama_config", check=BOOL),
    # the first Llama conversions' name for the context length, which transformers never read
    Carry("max_sequence_length", check=POSITIVE_INT),
    NoOp(
        "rope_interleaved",
        (False,),
        "interleaved rotary pairs are not the halves transformers' Llama-layout classes rotate",
    ),
)


def layout_with_defaults(**defaults) -> tuple:
    """:data:`LLAMA_LAYOUT` with some fields' defaults (``rope_theta=2e6``) replaced: a config.json
    that leaves a field out gets its HF config class's default, which is not Llama's in every
    class (tests/test_noop_fields.py holds each family's defaults to its classes')."""
    import dataclasses

    out = tuple(
        dataclasses.replace(e, default=defaults[e.hf]) if getattr(e, "hf", None) in defaults else e
        for e in LLAMA_LAYOUT
    )
    missing = set(defaults) - {getattr(e, "hf", None) for e in LLAMA_LAYOUT}
    assert not missing, f"not fields of the Llama layout: {missing}"
    return out


CONFIG = (
    *LLAMA_LAYOUT,
    Field("head_dim", "kv_channels", default=None),
    BIASES,
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
    EMBEDDING,
    Rename(_L + "input_layernorm.weight", _M + "input_layernorm.weight"),
    *attention(_L + "self_attn.", _M + "self_attention.", qkv_bias=_biased, proj_bias=_biased),
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
    *FINAL_NORM_AND_HEAD,
    Ignore(_L + "self_attn.rotary_emb.inv_freq", "a buffer recomputed from rope_theta"),
)


def shape_context(config: LlamaCore, vocab_size: int) -> ShapeContext:
    """Shape facts of a Llama-layout config for the transforms (``vocab_size`` is the HF, unpadded one)."""
    return ShapeContext.from_config(
        config, vocab_size, attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear
    )


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.llama_nemo:LlamaConfig",
    model_cls="models.llama_nemo:LlamaModel",
    core_config_cls="models.llama:LlamaCore",
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
