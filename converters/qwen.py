"""Qwen family <-> HF ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``: config mapping, weight table,
NeMo connectors.

Built on the Llama layout (:mod:`converters.llama`): the same fields and the same table, plus
Qwen2's q/k/v biases (``add_qkv_bias``; ``o_proj`` and the MLP have none) and Qwen3's per-head
``q_norm``/``k_norm`` (``qk_layernorm``: Megatron's ``q_layernorm``/``k_layernorm`` over
``kv_channels``, applied, as in HF, after the projection and before the rotary embedding).

Sliding-window attention is refused: Qwen2/3 apply it only from ``max_window_layers`` on and only
when ``use_sliding_window`` is true, which no released Qwen2/3 checkpoint sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from converters.llama import HEAD_DIM_OR_NULL, LLAMA_LAYOUT, ROPE_SCALING, check_model_type
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from porting.contract.config_map import Derived, NoOp
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import Fused, Rename
from porting.contract.transforms import QKV
from porting.errors import PortingError

_MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.qwen import QwenCore


def _attention_to_mcore(hf: dict) -> dict:
    mtype = check_model_type(hf, _MODEL_TYPES)
    if mtype == "qwen2":
        if "attention_bias" in hf:
            raise PortingError(
                "config.json: attention_bias is not a Qwen2 field (Qwen2 always biases q/k/v)"
            )
        return {"add_qkv_bias": True, "qk_layernorm": False}
    if hf.get("attention_bias", False) is not False:
        # Qwen3's attention_bias also biases o_proj; Megatron biases o_proj only together with
        # the MLP (add_bias_linear), which Qwen3 does not bias.
        raise PortingError(
            f"config.json: attention_bias={hf['attention_bias']!r} is not supported: it biases "
            "o_proj without the MLP, which Megatron cannot express"
        )
    return {"add_qkv_bias": False, "qk_layernorm": True}


def _attention_to_hf(c) -> dict:
    return {}  # model_type and attention_bias are carried verbatim in the original config


def window_to_mcore(hf: dict) -> dict:
    """Refuse Qwen's sliding window (see the module docstring); return no Megatron fields."""
    if hf.get("use_sliding_window", False) is not False:
        raise PortingError(
            f"config.json: use_sliding_window={hf['use_sliding_window']!r} is not supported: "
            "Qwen's window applies from max_window_layers on, which this family does not model "
            "(no released Qwen2/Qwen3 checkpoint turns it on)"
        )
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise PortingError(
            f"config.json: layer_types names {sorted(set(sliding))} layers; only full attention "
            "is supported by the Qwen family"
        )
    return {}


# Qwen2.5's configs say use_mrope: false: multimodal rotary sections are Qwen2-VL's, which the
# text classes never apply
USE_MROPE = NoOp(
    "use_mrope",
    (False,),
    "multimodal rotary sections (Qwen2-VL's M-RoPE) are not the text model's rotary embedding",
)

CONFIG = (
    *LLAMA_LAYOUT,
    ROPE_SCALING,
    HEAD_DIM_OR_NULL,  # Qwen2 has none (hidden/heads); Qwen3's is apart from hidden/heads
    USE_MROPE,
    Derived(("model_type", "attention_bias"), _attention_to_mcore, _attention_to_hf),
    # carried unchanged when use_sliding_window is false: they then do not change the maths
    Derived(
        ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
        window_to_mcore,
        lambda c: {},
    ),
)


@dataclass(frozen=True)
class QwenShapeContext(ShapeContext):
    """Adds the two Qwen switches the table's ``when`` predicates read."""

    qkv_bias: bool = False
    qk_norm: bool = False


_L = "model.layers.*."
_M = "decoder.layers.*."

# The Llama table serves as is (its all-linear biases stay off: add_bias_linear is false), plus:
WEIGHTS = (
    *LLAMA_WEIGHTS,
    Fused(
        (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
        _M + "self_attention.linear_qkv.bias",
        QKV,
        when=lambda c: c.qkv_bias,
    ),
    Rename(
        _L + "self_attn.q_norm.weight",
        _M + "self_attention.q_layernorm.weight",
        when=lambda c: c.qk_norm,
    ),
    Rename(
        _L + "self_attn.k_norm.weight",
        _M + "self_attention.k_layernorm.weight",
        when=lambda c: c.qk_norm,
    ),
)


def shape_context(config: QwenCore, vocab_size: int) -> QwenShapeContext:
    """Shape facts of a Qwen config for the table (``vocab_size`` is the HF, unpadded one)."""
    return QwenShapeContext.from_config(
        config, vocab_size, qkv_bias=config.add_qkv_bias, qk_norm=config.qk_layernorm
    )


FAMILY = Family(
    name="qwen",
    architectures=tuple(_MODEL_TYPES),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.qwen_nemo:QwenConfig",
    model_cls="models.qwen_nemo:QwenModel",
    core_config_cls="models.qwen:QwenCore",
    shape_context=shape_context,
    summary="Qwen2 (q/k/v biases) and Qwen3 (per-head QK RMSNorm) on the stock GPT spec",
    variants=(
        Variant("qwen2_tied", "Qwen2, q/k/v biases, tied output (0.5B-1.5B)"),
        Variant("qwen2_untied", "Qwen2, untied output (7B and up)"),
        Variant("qwen3_tied", "Qwen3, QK-norm, head_dim apart from hidden/heads, tied"),
        Variant("qwen3_untied", "Qwen3, untied output"),
    ),
)
