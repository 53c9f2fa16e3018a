"""Mistral family <-> HF ``MistralForCausalLM``: config mapping, weight table, NeMo connectors.

The Llama layout (:mod:`converters.llama`'s fields and table, unchanged) plus one field:
``sliding_window`` (``W`` or null) becomes Megatron's ``window_size=(W-1, 0)`` on every layer
(:mod:`models.mistral` says why ``W-1``).
"""

from __future__ import annotations

from converters.llama import HEAD_DIM_OR_NULL, LLAMA_LAYOUT, ROPE_SCALING
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from converters.llama import shape_context as llama_shape_context
from porting.contract.config_map import Field, Require
from porting.contract.container import VISION_LANGUAGE, Container
from porting.contract.family import Family, Variant

CONFIG = (
    *LLAMA_LAYOUT,
    HEAD_DIM_OR_NULL,
    # transformers' Mistral takes the shared rotary types (modeling_rope_utils) as Llama does
    ROPE_SCALING,
    Field(
        "sliding_window",
        "window_size",
        to_mcore=lambda w: None if w is None else (w - 1, 0),
        to_hf=lambda ws: None if ws is None else ws[0] + 1,
        # left out: MistralConfig's 4096; null: full attention; 0 is refused in every family
        # (config_map.WINDOW)
        default=4096,
    ),
    Require("model_type", lambda v: v == "mistral", "the HF side is the Mistral layout"),
)

FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    config_entries=CONFIG,
    weights=LLAMA_WEIGHTS,
    config_cls="models.mistral_nemo:MistralConfig",
    model_cls="models.mistral_nemo:MistralModel",
    core_config_cls="models.mistral:MistralCore",
    shape_context=llama_shape_context,
    # Mistral Small 3.1 and 3.2: the language model inside the vision-language class
    containers=(
        Container("Mistral3ForConditionalGeneration", "MistralForCausalLM", VISION_LANGUAGE),
    ),
    summary="Llama layout with sliding-window attention (window_size) on the stock GPT spec",
    variants=(
        Variant("window", "sliding window shorter than the prompts (7B v0.1 layout)"),
        Variant("no_window", "sliding_window null: full attention (v0.2 and later)"),
        Variant("tied", "tied output"),
    ),
)
