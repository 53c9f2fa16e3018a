"""Gemma family <-> HF ``GemmaForCausalLM`` / ``Gemma2ForCausalLM``: config mapping, weight table,
NeMo connectors.

The HF tensors have Llama's names; what differs is the maths (:mod:`models.gemma`) and, for
Gemma 2, where ``post_attention_layernorm`` goes: in Gemma it is the norm before the MLP (Llama's
meaning), in Gemma 2 the norm after attention, which sits in ``linear_proj.post_layernorm``; Gemma
2's ``pre_feedforward_layernorm`` is then the norm before the MLP and ``post_feedforward_layernorm``
sits in ``linear_fc2.post_layernorm``. Norm weights are zero-centred on both sides: no transform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from converters.llama import FULL, LLAMA_LAYOUT, SLIDING, check_model_type, layer_windows
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from porting.contract.config_map import POSITIVE_INT, Carry, Derived, Field, NoOp
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import Rename
from porting.contract.named import Named
from porting.errors import PortingError

_MODEL_TYPES = {"GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2"}
_ACTIVATIONS = {
    "gelu_pytorch_tanh": Named("models.gemma:gelu_tanh"),
    "gelu": Named("models.gemma:gelu_erf"),
}

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.gemma import GemmaCore


def _activation(name, field: str):
    if name not in _ACTIVATIONS:
        raise PortingError(
            f"config.json: {field}={name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]


def _activation_fields(hf: dict) -> tuple[str, str]:
    """(the activation field the reference class reads, the other one): transformers 4.57's
    GemmaMLP reads hidden_act, Gemma2MLP hidden_activation."""
    if hf.get("model_type") == "gemma2":
        return "hidden_activation", "hidden_act"
    return "hidden_act", "hidden_activation"


def _layout_to_mcore(hf: dict) -> dict:
    """model_type, the activation fields and the Gemma 2 switches, checked together."""
    mtype = check_model_type(hf, _MODEL_TYPES)
    if hf.get("attention_bias", False) is not False:
        raise PortingError(
            f"config.json: attention_bias={hf['attention_bias']!r} is not supported: it biases "
            "o_proj without the MLP, which Megatron cannot express"
        )
    gemma2 = mtype == "gemma2"
    # the other field is carried unread, as in transformers (_activation_note says so)
    used, _ = _activation_fields(hf)
    act = hf.get(used, "gelu_pytorch_tanh")
    out = {"activation_func": _activation(act, used), "sandwich_norms": gemma2}
    gemma2_only = (
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_types",
    )
    if not gemma2:
        present = [k for k in gemma2_only if k in hf]
        if present:
            raise PortingError(f"config.json: {', '.join(present)} are Gemma 2 fields, not Gemma's")
        return out
    # types, ranges and the layer count are the shared rules' (config_map.FIELD_RULES, RELATIONS)
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    window, pattern = layer_windows(hf, types, 4096)
    scalar = hf.get("query_pre_attn_scalar", 256)
    return out | {
        "softmax_scale": float(scalar) ** -0.5,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0),
        "window_size": window,
        "window_attn_skip_freq": pattern,
    }


def _activation_note(hf: dict) -> str | None:
    """Gemma-7B's later revision says hidden_act "gelu" and hidden_activation "gelu_pytorch_tanh":
    the reference class reads one of them (transformers 4.57: GemmaMLP ``config.hidden_act``,
    Gemma2MLP ``config.hidden_activation``, whatever the config docstring says), and the other is
    carried unread, as in transformers. Said at import, since the two disagree."""
    used, other = _activation_fields(hf)
    act = hf.get(used, "gelu_pytorch_tanh")
    if hf.get(other) in (None, act):
        return None
    return (
        f"config.json: {used}={act!r} is what transformers' {hf['architectures'][0]} computes "
        f"(and so does this checkpoint); {other}={hf[other]!r} is carried unread, as there"
    )


# The Llama layout's fields, less two that Gemma reads otherwise: the activation (hidden_act or
# hidden_activation, decided below) and the output tie (true unless said).
_GEMMA_OWN = ("hidden_act", "tie_word_embeddings")

CONFIG = (
    *(e for e in LLAMA_LAYOUT if getattr(e, "hf", None) not in _GEMMA_OWN),
    # narrower than the shared rule: transformers' Gemma reads config.head_dim, null included
    Field("head_dim", "kv_channels", check=POSITIVE_INT),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", default=True),
    # every value is carried verbatim in the original config; export rewrites none of them
    Derived(
        (
            "model_type",
            "attention_bias",
            "hidden_act",
            "hidden_activation",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "sliding_window",
            "layer_types",
        ),
        _layout_to_mcore,
        lambda c: {},
        note=_activation_note,
    ),
    Carry("cache_implementation"),  # generation-time cache choice
    # Gemma-7B's config.json says rope_scaling: null; Gemma's rotary embedding is unscaled here
    NoOp("rope_scaling", (None,), "this family's Gemma rotary embedding is unscaled"),
    # transformers 5 writes it null for Gemma and Gemma 2 (EmbeddingGemma's switch, added to the
    # classes they share); their attention is causal
    NoOp(
        "use_bidirectional_attention",
        (None, False),
        "bidirectional attention (EmbeddingGemma) drops the causal mask",
    ),
    # Gemma-2-9B's config.json repeats sliding_window under its early name, unread by transformers
    NoOp(
        "sliding_window_size",
        same_as="sliding_window",
        why="a window apart from sliding_window would say two things at once",
    ),
)


@dataclass(frozen=True)
class GemmaShapeContext(ShapeContext):
    """Adds Gemma 2's sandwich norms, which the table's ``when`` predicates read."""

    sandwich: bool = False


_L = "model.layers.*."
_M = "decoder.layers.*."
_POST_ATTN = _L + "post_attention_layernorm.weight"


def _sandwich(c: GemmaShapeContext) -> bool:
    return c.sandwich


WEIGHTS = (
    *(e for e in LLAMA_WEIGHTS if getattr(e, "hf", None) != _POST_ATTN),
    Rename(_POST_ATTN, _M + "pre_mlp_layernorm.weight", when=lambda c: not c.sandwich),
    Rename(_POST_ATTN, _M + "self_attention.linear_proj.post_layernorm.weight", when=_sandwich),
    Rename(
        _L + "pre_feedforward_layernorm.weight", _M + "pre_mlp_layernorm.weight", when=_sandwich
    ),
    Rename(
        _L + "post_feedforward_layernorm.weight",
        _M + "mlp.linear_fc2.post_layernorm.weight",
        when=_sandwich,
    ),
)


def shape_context(config: GemmaCore, vocab_size: int) -> GemmaShapeContext:
    """Shape facts of a Gemma config for the table (``vocab_size`` is the HF, unpadded one)."""
    return GemmaShapeContext.from_config(config, vocab_size, sandwich=config.sandwich_norms)


FAMILY = Family(
    name="gemma",
    architectures=tuple(_MODEL_TYPES),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.gemma_nemo:GemmaConfig",
    model_cls="models.gemma_nemo:GemmaModel",
    core_config_cls="models.gemma:GemmaCore",
    shape_context=shape_context,
    # soft-capping exists only in transformers' eager attention for Gemma 2
    hf_attn_implementation="eager",
    context_symbols=(
        "models.gemma:gemma_block_spec",
        "models.gemma:gelu_tanh",
        "models.gemma:gelu_erf",
    ),
    summary="Gemma ((1+w) fp32 RMSNorm, scaled embeddings, GeGLU) and Gemma 2 (sandwich norms, "
    "soft-capping, alternating sliding window): a custom spec",
    variants=(
        Variant("gemma_mqa", "Gemma-2B layout: MQA, head_dim apart, tied, tanh GeGLU"),
        Variant("gemma_mha_erf", "Gemma-7B layout: MHA, exact-erf GeGLU (hidden_act gelu)"),
        Variant("gemma2", "Gemma 2: GQA, sandwich norms, both soft-caps, alternating window"),
        Variant("gemma2_untied_nocap", "Gemma 2 untied, soft-caps null"),
    ),
)
