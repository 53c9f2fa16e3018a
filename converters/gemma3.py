"""Gemma 3 family <-> HF ``Gemma3ForCausalLM`` (the text-only checkpoints, ``model_type:
gemma3_text``): config mapping, weight table.

Gemma 3's text decoder is Gemma 2's (:mod:`converters.gemma`: ``(1+w)`` fp32 norms, sandwich
norms, scaled embeddings, GeGLU, ``query_pre_attn_scalar``, the final soft-cap if set; the
attention soft-cap only at null, the one value transformers' Gemma 3 computes), plus two things:
a ``(1+w)`` RMSNorm on each query and key head (``q_norm``/``k_norm``, Megatron's
``q_layernorm``/``k_layernorm``), and a rotary table per layer type: local (sliding-window) layers
rotate with base ``rope_local_base_freq`` unscaled, global ones with ``rope_theta`` under
``rope_scaling`` (:mod:`models.gemma3`). Norm weights are zero-centred on both sides: no transform.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from converters import gemma
from converters.llama import FULL, ROPE_SCALING, SLIDING, check_model_type, layer_windows
from porting.contract.config_map import POSITIVE_INT, Carry, Derived, Field, NoOp
from porting.contract.container import VISION_LANGUAGE, Container
from porting.contract.family import Family, Variant
from porting.contract.mapping import Rename
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.gemma3 import Gemma3Core


def _layer_types(hf: dict) -> list[str]:
    """Each layer's kind, as ``Gemma3TextConfig`` decides it: ``layer_types`` when given, else
    every ``sliding_window_pattern``-th layer global (6 unless said). The saved
    ``_sliding_window_pattern`` is not read there (the config overwrites it), nor here."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        types = [(SLIDING, FULL)[(i + 1) % pattern == 0] for i in range(n)]
    return types


def _rope_to_mcore(hf: dict) -> dict:
    """The global layers' ``rope_scaling``: null, default or linear (the published ones); the
    local layers' table is never scaled (``Gemma3TextModel`` builds it with ``default``)."""
    kind = ROPE_SCALING.to_mcore(hf)
    if kind["rope_scaling_type"] is None:
        return {}
    if kind["rope_scaling_type"] == "linear":
        return {"seq_len_interpolation_factor": kind["seq_len_interpolation_factor"]}
    raise PortingError(
        f"config.json: rope_scaling type {kind['rope_scaling_type']!r} is not supported by the "
        "gemma3 family (supported: null, 'default', 'linear')"
    )


def _layout_to_mcore(hf: dict) -> dict:
    """model_type, the activation, the layer kinds with their window and rotary tables, and
    Gemma 2's scale and caps, checked together (types and ranges: config_map.FIELD_RULES)."""
    check_model_type(hf, {"Gemma3ForCausalLM": "gemma3_text"})
    if hf.get("attention_bias", False) is not False:
        raise PortingError(
            f"config.json: attention_bias={hf['attention_bias']!r} is not supported: it biases "
            "o_proj without the MLP, which Megatron cannot express"
        )
    window, pattern = layer_windows(hf, _layer_types(hf), 4096)
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    return {
        "activation_func": gemma._activation(act, "hidden_activation"),
        "softmax_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
        "window_size": window,
        "window_attn_skip_freq": pattern,
        "rotary_base_local": float(hf.get("rope_local_base_freq", 10_000.0)),
        **_rope_to_mcore(hf),
    }


# Gemma's entries (the Llama layout's sizes, head_dim, the tied output, cache_implementation),
# less its Gemma/Gemma 2 layout and its rope_scaling, which Gemma 3 reads otherwise, and two whose
# absent value Gemma3TextConfig fills in otherwise.
_GEMMA3_OWN = ("rope_scaling", "rope_theta", "num_key_value_heads")
_GEMMA_SHARED = tuple(
    e
    for e in gemma.CONFIG
    if not (isinstance(e, Derived) and set(e.hf) & {"model_type", *_GEMMA3_OWN})
    and getattr(e, "hf", None) not in _GEMMA3_OWN
)

CONFIG = (
    *_GEMMA_SHARED,
    Field("rope_theta", "rotary_base", default=1_000_000.0),
    # narrower than the shared rule: Gemma3Attention reads the count as it is, null included
    Field("num_key_value_heads", "num_query_groups", default=4, check=POSITIVE_INT),
    # every value is carried verbatim in the original config; export rewrites none of them
    Derived(
        (
            "model_type",
            "attention_bias",
            "hidden_activation",
            "query_pre_attn_scalar",
            "final_logit_softcapping",
            "sliding_window",
            "layer_types",
            "sliding_window_pattern",
            "rope_local_base_freq",
            "rope_scaling",
        ),
        _layout_to_mcore,
        lambda c: {},
    ),
    NoOp(
        "attn_logit_softcapping",
        (None,),
        "transformers 4.57's Gemma3Attention stores it but never passes it to the attention, so "
        "the reference would ignore a cap that the config asks for",
    ),
    # Gemma3TextConfig overwrites it from sliding_window_pattern (or 6): saved, never read
    Carry("_sliding_window_pattern"),
    NoOp(
        "use_bidirectional_attention",
        (False,),
        "bidirectional attention (EmbeddingGemma) drops the causal mask and halves the window",
    ),
)

_L = "model.layers.*."
_M = "decoder.layers.*.self_attention."

WEIGHTS = (
    *gemma.WEIGHTS,
    Rename(_L + "self_attn.q_norm.weight", _M + "q_layernorm.weight"),
    Rename(_L + "self_attn.k_norm.weight", _M + "k_layernorm.weight"),
)


def shape_context(config: Gemma3Core, vocab_size: int) -> gemma.GemmaShapeContext:
    """Shape facts of a Gemma 3 config for the table (``vocab_size`` is the HF, unpadded one)."""
    return gemma.GemmaShapeContext.from_config(config, vocab_size, sandwich=True)


FAMILY = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.gemma3_nemo:Gemma3Config",
    model_cls="models.gemma3_nemo:Gemma3Model",
    core_config_cls="models.gemma3:Gemma3Core",
    shape_context=shape_context,
    hf_attn_implementation="eager",
    context_symbols=(
        "models.gemma3:gemma3_block_spec",
        "models.gemma:gelu_tanh",
        "models.gemma:gelu_erf",
    ),
    # the 4B, 12B and 27B releases: the language model inside the vision-language class
    containers=(
        Container(
            "Gemma3ForConditionalGeneration",
            "Gemma3ForCausalLM",
            VISION_LANGUAGE,
            # its forward returns the head's logits as they are; only the text class caps them
            unapplied=("final_logit_softcapping",),
        ),
    ),
    summary="Gemma 3: Gemma 2's decoder with per-head q/k (1+w) norms and local/global "
    "layers, each kind with its own rotary base (linear scaling on the global ones)",
    variants=(
        Variant("gemma3", "gemma-3-1b layout: MQA, local:global 5:1, window, two rotary bases"),
        Variant("gemma3_gqa_linear", "GQA, global rope_scaling linear (the 4b+ text config)"),
        Variant("gemma3_untied_cap", "untied output, final logit soft-cap set"),
    ),
)
