"""Falcon-style family <-> HF ``FalconForCausalLM``: config mapping, weight table, NeMo connectors.

Parity is checked against the third-party ``transformers`` Falcon implementation. The variant
(7B MQA parallel, 40B/180B two-norm GQA, 11B one-norm GQA, RW sequential ALiBi) is chosen by the
config switches alone (``new_decoder_architecture``, ``multi_query``, ``parallel_attn``,
``num_ln_in_parallel_attn``, ``alibi``, ``bias``), never by a model name. Layout facts:

- ``query_key_value`` copies verbatim into ``linear_qkv`` (see the comment at its table entry).
- The MLP is ungated: ``dense_h_to_4h`` is ``linear_fc1`` as it is.
- HF ``rotate_half`` rotary and Megatron's non-interleaved rotary are the same convention
  (``transformers/models/falcon/modeling_falcon.py`` vs
  ``megatron/core/models/common/embeddings/rope_utils.py``); no q/k row permutation.
- The norms a layer has depend on its block: sequential ``input_layernorm`` +
  ``post_attention_layernorm``; parallel with one norm ``input_layernorm``; parallel with two
  ``ln_attn`` + ``ln_mlp``. They land on Megatron's ``input_layernorm`` / ``pre_mlp_layernorm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.falcon_block import FalconBlock, falcon_block
from porting.contract.config_map import Derived, Field, Require
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import Fused, Ignore, Rename
from porting.contract.transforms import VOCAB_PAD
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.falcon import FalconCore


def _query_groups_to_mcore(hf: dict) -> dict:
    """Megatron's query-group count for the HF attention layout; validates the switches together."""
    # that the heads divide hidden_size is the shared rule's (config_map.RELATIONS)
    heads = hf["num_attention_heads"]
    try:
        falcon_block(
            new_decoder_architecture=hf.get("new_decoder_architecture", False),
            parallel_attn=hf.get("parallel_attn", True),
            num_ln_in_parallel_attn=hf.get("num_ln_in_parallel_attn"),
        )
    except ValueError as err:
        raise PortingError(f"config.json: {err}") from err
    kv = hf.get("num_kv_heads")
    if hf.get("new_decoder_architecture", False):
        kv = heads if kv is None else kv
        # not the shared rule: num_kv_heads means KV heads only in the new architecture
        if heads % kv:
            raise PortingError(
                f"config.json: num_kv_heads={kv!r} does not divide num_attention_heads={heads}"
            )
        return {"num_query_groups": kv}
    if hf.get("multi_query", True):
        # transformers ignores num_kv_heads here (FalconAttention: one KV head)
        return {"num_query_groups": 1}
    if kv not in (None, heads):
        raise PortingError(
            f"config.json: num_kv_heads={kv} with multi_query=False and "
            "new_decoder_architecture=False is not supported: this layout has one KV head per "
            f"query head ({heads}), and transformers' Falcon cannot run it either"
        )
    return {"num_query_groups": heads}


def _query_groups_to_hf(c: FalconCore) -> dict:
    # num_kv_heads means something only in the new architecture; elsewhere it is carried as it was
    # (the classic layouts are fixed by multi_query, which FalconCore keeps consistent).
    return {"num_kv_heads": c.num_query_groups} if c.new_decoder_architecture else {}


def _ffn_to_mcore(hf: dict) -> dict:
    ffn = hf.get("ffn_hidden_size")
    # transformers' FalconConfig: None means 4 * hidden_size (Falcon-7B's config.json omits it)
    return {"ffn_hidden_size": 4 * hf["hidden_size"] if ffn is None else ffn}


def _ffn_to_hf(c: FalconCore) -> dict:
    # At the default the original spelling (absent, null or explicit) is carried unchanged.
    return {} if c.ffn_hidden_size == 4 * c.hidden_size else {"ffn_hidden_size": c.ffn_hidden_size}


def _zero(v) -> bool:
    # a number equal to 0 (JSON false == 0.0 in Python, but is no dropout rate)
    return not isinstance(v, bool) and v == 0.0


# Each value's type and range is the rule every family shares for that field
# (config_map.FIELD_RULES).
CONFIG = (
    Field("num_hidden_layers", "num_layers"),
    Field("hidden_size", "hidden_size"),
    Field("num_attention_heads", "num_attention_heads"),
    # null: one KV head per query head (new architecture) or ignored (classic layouts)
    Derived(("num_kv_heads",), _query_groups_to_mcore, _query_groups_to_hf),
    # null: 4 * hidden_size
    Derived(("ffn_hidden_size",), _ffn_to_mcore, _ffn_to_hf),
    Field("new_decoder_architecture", "new_decoder_architecture", default=False),
    Field("multi_query", "multi_query", default=True),
    Field("parallel_attn", "parallel_attn", default=True),
    Field("num_ln_in_parallel_attn", "num_ln_in_parallel_attn", default=None),
    Field("alibi", "alibi", default=False),
    Field("bias", "add_bias_linear", default=False),
    Field("layer_norm_epsilon", "layernorm_epsilon", default=1e-5),
    Field("rope_theta", "rotary_base", default=10000.0),
    Field("max_position_embeddings", "seq_length", default=2048),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", default=True),
    Field("initializer_range", "init_method_std", default=0.02),
    Require("activation", lambda v: v == "gelu", "the family's MLP is exact (erf) GELU"),
    Require("rope_scaling", lambda v: v is None, "only unscaled rotary (rope_theta) is supported"),
    Require(
        "hidden_dropout",
        _zero,
        "transformers' Falcon drops out different sums per variant than Megatron; set dropout on "
        "the NeMo config for training instead",
    ),
    Require(
        "attention_dropout",
        _zero,
        "transformers' Falcon applies it to the attention residual (sequential) and to ALiBi "
        "probabilities only, unlike Megatron; set dropout on the NeMo config for training instead",
    ),
    Require(
        "apply_residual_connection_post_layernorm",
        lambda v: v is False,
        "transformers' Falcon ignores it, so a checkpoint trained with it has no reference to match",
    ),
    Require("model_type", lambda v: v == "falcon", "the HF side is transformers' Falcon layout"),
)


@dataclass(frozen=True)
class FalconShapeContext(ShapeContext):
    """:class:`ShapeContext` plus the decoder block, which decides the per-layer norm keys."""

    block: FalconBlock = FalconBlock.SEQUENTIAL


def _biased(ctx: FalconShapeContext) -> bool:
    return ctx.attention_bias


def _sequential(ctx: FalconShapeContext) -> bool:
    return ctx.block == FalconBlock.SEQUENTIAL


def _two_norms(ctx: FalconShapeContext) -> bool:
    return ctx.block == FalconBlock.PARALLEL_TWO_NORMS


def _one_input_norm(ctx: FalconShapeContext) -> bool:
    return ctx.block != FalconBlock.PARALLEL_TWO_NORMS


_L = "transformer.h.*."
_M = "decoder.layers.*."


def _norm(hf: str, mcore: str, when) -> tuple[Rename, Rename]:
    """A LayerNorm's weight and bias (Falcon's norms always have a bias)."""
    return (
        Rename(f"{hf}.weight", f"{mcore}.weight", when=when),
        Rename(f"{hf}.bias", f"{mcore}.bias", when=when),
    )


def _linear(hf: str, mcore: str) -> tuple[Rename, Rename]:
    """A linear layer's weight, and its bias where the config has ``bias=True``."""
    return (
        Rename(f"{hf}.weight", f"{mcore}.weight"),
        Rename(f"{hf}.bias", f"{mcore}.bias", when=_biased),
    )


WEIGHTS = (
    Fused(("transformer.word_embeddings.weight",), "embedding.word_embeddings.weight", VOCAB_PAD),
    *_norm(_L + "input_layernorm", _M + "input_layernorm", _one_input_norm),
    *_norm(_L + "post_attention_layernorm", _M + "pre_mlp_layernorm", _sequential),
    *_norm(_L + "ln_attn", _M + "input_layernorm", _two_norms),
    *_norm(_L + "ln_mlp", _M + "pre_mlp_layernorm", _two_norms),
    # Verbatim: transformers' FalconAttention._split_heads reads query_key_value as, per query
    # group, that group's query heads then one key head then one value head (new architecture:
    # view [ng, np/ng + 2, hn]; multi_query: [np + 2, hn], i.e. one group; classic MHA:
    # [np, 3, hn], i.e. np groups of one query head), which is exactly Megatron-Core's
    # linear_qkv layout [ng, (np/ng + 2) * hn] (megatron/core/transformer/attention.py,
    # SelfAttention.get_query_key_value_tensors) once num_query_groups is num_kv_heads, 1 or np.
    # The parity tests cover all three.
    *_linear(_L + "self_attention.query_key_value", _M + "self_attention.linear_qkv"),
    *_linear(_L + "self_attention.dense", _M + "self_attention.linear_proj"),
    *_linear(_L + "mlp.dense_h_to_4h", _M + "mlp.linear_fc1"),
    *_linear(_L + "mlp.dense_4h_to_h", _M + "mlp.linear_fc2"),
    *_norm("transformer.ln_f", "decoder.final_layernorm", None),
    Fused(("lm_head.weight",), "output_layer.weight", VOCAB_PAD, when=lambda c: not c.tied_output),
    Ignore(
        "lm_head.weight",
        "tied to transformer.word_embeddings.weight; transformers ignores it too",
        when=lambda c: c.tied_output,
    ),
)


def shape_context(config: FalconCore, vocab_size: int) -> FalconShapeContext:
    """Shape facts of a Falcon config for the table (``vocab_size`` is the HF, unpadded one)."""
    return FalconShapeContext.from_config(
        config,
        vocab_size,
        attention_bias=config.add_bias_linear,
        mlp_bias=config.add_bias_linear,
        block=config.block,
    )


def plan_shape(cfg: dict, source: str, read) -> dict:
    """What the planner needs from a Falcon config (``Family.plan_shape``): transformers'
    FalconConfig / modeling_falcon.py's reading, MQA for 7B, ``num_kv_heads`` groups for the new
    decoder architecture (40B, 180B, 11B), MHA for the RW layout, and its one or two norms.
    ``read``: the planner's readers (:class:`porting.planner.model.Readers`)."""
    count, need = read.count, read.need
    experts = next((cfg[k] for k in read.expert_fields if cfg.get(k)), None)
    if experts:
        raise PortingError(
            f"{source}: a Falcon-layout config with experts ({read.show(experts)}): the planner "
            "reads experts in the Llama, Qwen and DeepSeek layouts only"
        )
    hidden = need(cfg, source, "hidden", "hidden_size", "n_embed")
    heads = need(cfg, source, "heads", "num_attention_heads", "n_head")
    head_dim = cfg.get("head_dim") or 0
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    if new_arch:
        kv = count(cfg.get("num_kv_heads", heads), "num_kv_heads", source, "kv_heads")
    elif cfg.get("multi_query", True):
        kv = 1
    else:
        kv = heads
    parallel = bool(cfg.get("parallel_attn", True)) or new_arch
    if new_arch:
        norms = 1 if cfg.get("num_ln_in_parallel_attn") == 1 else 2
    else:
        norms = 1 if parallel else 2
    return dict(
        hidden=hidden,
        layers=need(cfg, source, "layers", "num_hidden_layers", "n_layer"),
        heads=heads,
        kv_heads=kv,
        ffn=count(cfg.get("ffn_hidden_size") or 4 * hidden, "ffn_hidden_size", source, "ffn"),
        vocab=need(cfg, source, "vocab", "vocab_size"),
        tied=bool(cfg.get("tie_word_embeddings", True)),
        gated=False,
        head_dim=count(head_dim, "head_dim", source, "head_dim") if head_dim else 0,
        parallel_attn=parallel,
        norms_per_layer=norms,
        layernorm=True,
        bias=bool(cfg.get("bias", False)),
    )


FAMILY = Family(
    name="falcon",
    architectures=("FalconForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.falcon_nemo:FalconConfig",
    model_cls="models.falcon_nemo:FalconModel",
    core_config_cls="models.falcon:FalconCore",
    shape_context=shape_context,
    # transformers' default for Falcon; its eager path (4.57) adds ALiBi a second time through the
    # causal mask (FalconModel._update_causal_mask), unlike the original RW code and sdpa
    hf_attn_implementation="sdpa",
    context_symbols=("models.falcon:falcon_layer_spec",),
    plan_shape=plan_shape,
    summary="parallel attention+MLP, MQA/GQA, one or two norms, ALiBi (RW): a custom spec",
    variants=(
        Variant("7b_mqa", "MQA, parallel block with one shared norm, tied output"),
        Variant("40b_gqa_two_norms", "new decoder architecture, GQA, two norms (40B, 180B)"),
        Variant("11b_gqa_one_norm_untied", "new decoder architecture, one norm, untied (11B)"),
        Variant("rw_alibi_biases", "sequential block, MHA with ALiBi, biases everywhere (RW)"),
        Variant("alibi_parallel_mqa", "ALiBi in the 7B parallel MQA block"),
    ),
)
