"""Granite family <-> HF ``GraniteForCausalLM`` (IBM Granite 3.x dense): config mapping; the Llama
weight table.

The Llama layout (:mod:`converters.llama`'s fields and tensor names) with four multipliers
(transformers 4.57 and 5.x, ``models/granite``), each a Megatron config field
(:mod:`models.granite` says where each acts):

- ``attention_multiplier``: the attention scores' scale in place of ``1 / sqrt(head_dim)``
  (``GraniteAttention.scaling``), Megatron's ``softmax_scale``; its default is 1.0, not the usual
  scale;
- ``embedding_multiplier``: the embeddings are multiplied by it before the first layer;
- ``residual_multiplier``: each sublayer's output (attention, MLP) is multiplied by it before the
  residual add;
- ``logits_scaling``: the logits are divided by it.

``head_dim`` is read as ``GraniteAttention`` reads it (``getattr``, so a null fails there and is
refused here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from converters.llama import BIASES, LLAMA_LAYOUT, ROPE_SCALING, head_dim_read_by
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from converters.llama import shape_context as llama_shape_context
from porting.contract.config_map import POSITIVE_FLOAT, Field, Require
from porting.contract.family import Family, ShapeContext, Variant

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.granite import GraniteCore


def multiplier(hf: str, mcore: str) -> Field:
    """The Field of one Granite multiplier (a finite number > 0; 1.0 where left out)."""
    # transformers' GraniteConfig default for each is 1.0 (for the attention scale too)
    return Field(hf, mcore, to_mcore=float, default=1.0, check=POSITIVE_FLOAT)


# HF field -> Megatron field
MULTIPLIERS = {
    "attention_multiplier": "softmax_scale",
    "embedding_multiplier": "embedding_multiplier",
    "residual_multiplier": "residual_multiplier",
    "logits_scaling": "logits_scaling",
}

CONFIG = (
    *LLAMA_LAYOUT,
    BIASES,
    ROPE_SCALING,
    head_dim_read_by("GraniteAttention"),
    *(multiplier(hf, mcore) for hf, mcore in MULTIPLIERS.items()),
    Require("model_type", lambda v: v == "granite", "the HF side is the Granite layout"),
)


def shape_context(config: GraniteCore, vocab_size: int) -> ShapeContext:
    """Shape facts of a Granite config for the table (``vocab_size`` is the HF, unpadded one)."""
    return llama_shape_context(config, vocab_size)


FAMILY = Family(
    name="granite",
    architectures=("GraniteForCausalLM",),
    config_entries=CONFIG,
    weights=LLAMA_WEIGHTS,
    config_cls="models.granite_nemo:GraniteConfig",
    model_cls="models.granite_nemo:GraniteModel",
    core_config_cls="models.granite:GraniteCore",
    shape_context=shape_context,
    summary="IBM Granite 3.x (dense): the Llama layout with embedding, attention, residual and "
    "logit multipliers on the stock GPT spec",
    variants=(
        Variant("granite3", "Granite 3.x layout: GQA, tied output, every multiplier set"),
        Variant("untied_biases", "untied output, every linear biased, a head_dim given"),
    ),
)
