"""SmolLM3 family <-> HF ``SmolLM3ForCausalLM``: config mapping; the Llama weight table.

The Llama layout (:mod:`converters.llama`'s fields and tensor names) with rotary-free layers named
per layer (transformers 4.57 and 5.x, ``models/smollm3``):

- ``no_rope_layers``: one entry per layer, **1 where the layer rotates** q and k
  (``SmolLM3Attention.use_rope``), 0 where it has no position encoding at all; absent, every
  ``no_rope_layer_interval``-th layer (default 4) is rotary-free. Megatron-Core's ``no_rope_freq``
  is the opposite list (1 where the layer skips the rotary embedding).
- a sliding window, only where ``use_sliding_window`` is on, on the layers ``layer_types`` names
  ``sliding_attention`` (by default the rotary-free ones): Megatron's ``window_size`` with a
  per-layer ``window_attn_skip_freq``. A sliding layer while the switch is off, or without a
  window, is refused: transformers would give it the sliding mask without a window.
- ``pretraining_tp`` and ``max_window_layers`` are read by no SmolLM3 class: carried.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from converters.llama import (
    BIASES,
    FULL,
    ROPE_SCALING,
    SLIDING,
    head_dim_read_by,
    layer_windows,
    layout_with_defaults,
    rotary_free_every_nth,
)
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from converters.llama import shape_context as llama_shape_context
from porting.contract.config_map import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    Carry,
    Derived,
    Require,
)
from porting.contract.family import Family, ShapeContext, Variant
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.smollm3 import SmolLM3Core


def rope_layers(hf: dict) -> list[int]:
    """Per layer, 1 where it rotates q and k: ``no_rope_layers`` as given, or every
    ``no_rope_layer_interval``-th layer rotary-free (``SmolLM3Config.__init__``)."""
    n = hf["num_hidden_layers"]
    given = hf.get("no_rope_layers")
    if given is None:
        return rotary_free_every_nth(hf)
    ok = isinstance(given, list) and all(v in (0, 1) and not isinstance(v, bool) for v in given)
    if not ok or len(given) != n:
        raise PortingError(
            f"config.json: no_rope_layers={given!r} must list 0 or 1 for each of the {n} layers "
            "(1: the layer rotates q and k)"
        )
    return list(given)


def _no_rope_to_mcore(hf: dict) -> dict:
    layers = rope_layers(hf)
    return {"no_rope_freq": [1 - r for r in layers] if 0 in layers else None}


def _windows_to_mcore(hf: dict) -> dict:
    rotary = rope_layers(hf)
    use, window = hf.get("use_sliding_window", False), hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:  # SmolLM3Config.__init__'s default
        slide = use and window is not None
        types = [SLIDING if slide and not r else FULL for r in rotary]
    if not isinstance(types, list) or len(types) != hf["num_hidden_layers"]:
        raise PortingError(
            f"config.json: layer_types={types!r} must name each of the "
            f"{hf['num_hidden_layers']} layers"
        )
    if SLIDING in types and not (use is True and window is not None):
        raise PortingError(
            f"config.json: layer_types names sliding layers while use_sliding_window={use!r} and "
            f"sliding_window={window!r}: transformers gives them a sliding mask without a window"
        )
    window_size, pattern = layer_windows(hf, types, None)
    return {"window_size": window_size, "window_attn_skip_freq": pattern if window_size else None}


CONFIG = (
    # SmolLM3Config's own defaults: tied (PretrainedConfig's, which it keeps) and a base of 2e6
    *layout_with_defaults(tie_word_embeddings=True, rope_theta=2000000.0),
    BIASES,
    ROPE_SCALING,
    head_dim_read_by("SmolLM3Attention"),
    Derived(("no_rope_layers", "no_rope_layer_interval"), _no_rope_to_mcore, lambda c: {}),
    Derived(
        ("use_sliding_window", "sliding_window", "layer_types"), _windows_to_mcore, lambda c: {}
    ),
    Carry("max_window_layers", check=NON_NEGATIVE_INT),
    Carry("pretraining_tp", check=POSITIVE_INT),
    Require("model_type", lambda v: v == "smollm3", "the HF side is the SmolLM3 layout"),
)


def shape_context(config: SmolLM3Core, vocab_size: int) -> ShapeContext:
    """Shape facts of a SmolLM3 config for the table (``vocab_size`` is the HF, unpadded one)."""
    return llama_shape_context(config, vocab_size)


FAMILY = Family(
    name="smollm3",
    architectures=("SmolLM3ForCausalLM",),
    config_entries=CONFIG,
    weights=LLAMA_WEIGHTS,
    config_cls="models.smollm3_nemo:SmolLM3Config",
    model_cls="models.smollm3_nemo:SmolLM3Model",
    core_config_cls="models.smollm3:SmolLM3Core",
    shape_context=shape_context,
    summary="SmolLM3: the Llama layout with rotary-free layers by a per-layer list (no_rope_freq) "
    "and an optional window on them, on the stock GPT spec",
    variants=(
        Variant("smollm3", "SmolLM3-3B layout: every 4th layer rotary-free, GQA, tied"),
        Variant("windowed", "a sliding window on the rotary-free layers, a list of its own"),
    ),
)
