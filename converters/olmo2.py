"""OLMo 2 family <-> HF ``Olmo2ForCausalLM``: config mapping, weight table, NeMo connectors.

The Llama layout's fields and tensor names (:mod:`converters.llama`), with three differences in the
maths (:mod:`models.olmo2`): no norm before attention or the MLP; ``post_attention_layernorm`` and
``post_feedforward_layernorm`` norm each sublayer's output before the residual add (they sit in
``linear_proj.post_layernorm`` and ``linear_fc2.post_layernorm``); ``q_norm`` and ``k_norm`` norm
the whole q and k projections (``heads x head_dim`` and ``kv_heads x head_dim`` wide), not each
head. ``attention_bias`` is refused: it biases ``o_proj`` without the MLP, which Megatron cannot
express.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from converters.llama import LLAMA_LAYOUT, ROPE_SCALING, check_model_type, head_dim_read_by
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from porting.contract.config_map import Derived
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import Rename
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.olmo2 import Olmo2Core


def attention_to_mcore(hf: dict, model_type: str) -> dict:
    """``model_type`` and ``attention_bias`` checked (OLMo 2 and OLMoE alike); no Megatron field."""
    check_model_type(hf, {hf["architectures"][0]: model_type})
    if hf.get("attention_bias", False) is not False:
        raise PortingError(
            f"config.json: attention_bias={hf['attention_bias']!r} is not supported: it biases "
            "q/k/v and o_proj without the MLP, which Megatron cannot express"
        )
    return {}


CONFIG = (
    *LLAMA_LAYOUT,
    ROPE_SCALING,
    head_dim_read_by("Olmo2Attention"),
    Derived(
        ("model_type", "attention_bias"), lambda hf: attention_to_mcore(hf, "olmo2"), lambda c: {}
    ),
)

_L = "model.layers.*."
_M = "decoder.layers.*."
# The Llama table's pre-norms have no place here; its biases stay off (attention_bias refused)
_PRE_NORMS = (_L + "input_layernorm.weight", _L + "post_attention_layernorm.weight")

WEIGHTS = (
    *(e for e in LLAMA_WEIGHTS if getattr(e, "hf", None) not in _PRE_NORMS),
    Rename(_L + "self_attn.q_norm.weight", _M + "self_attention.q_layernorm.weight"),
    Rename(_L + "self_attn.k_norm.weight", _M + "self_attention.k_layernorm.weight"),
    Rename(
        _L + "post_attention_layernorm.weight",
        _M + "self_attention.linear_proj.post_layernorm.weight",
    ),
    Rename(_L + "post_feedforward_layernorm.weight", _M + "mlp.linear_fc2.post_layernorm.weight"),
)


def shape_context(config: Olmo2Core, vocab_size: int) -> ShapeContext:
    """Shape facts of an OLMo 2 config for the table (``vocab_size`` is the HF, unpadded one)."""
    return ShapeContext.from_config(config, vocab_size)


FAMILY = Family(
    name="olmo2",
    architectures=("Olmo2ForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.olmo2_nemo:Olmo2Config",
    model_cls="models.olmo2_nemo:Olmo2Model",
    core_config_cls="models.olmo2:Olmo2Core",
    shape_context=shape_context,
    context_symbols=("models.olmo2:olmo2_block_spec",),
    summary="OLMo 2: post-norm layers (norms after attention and the MLP), q/k RMSNorm over the "
    "whole projection, tensor-parallel; a custom spec",
    variants=(
        Variant("mha_untied", "OLMo-2 7B/13B layout: MHA, untied output"),
        Variant("gqa", "OLMo-2 32B layout: grouped KV heads"),
        Variant("tied_head_dim", "tied output, head_dim apart from hidden/heads"),
    ),
)
