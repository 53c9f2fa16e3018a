"""The Mistral decoder: a Llama layout with sliding-window attention, on the stock GPT spec.

HF's window of ``W`` lets position ``i`` attend to keys ``i-W+1 .. i`` (``masking_utils``:
``kv_idx > q_idx - sliding_window``); Megatron's ``window_size=(left, right)`` lets it attend to
``i-left .. i+right``, so ``W`` is ``window_size=(W-1, 0)`` on every layer
(``window_attn_skip_freq`` unset). On the CPU the local spec's softmax builds that mask through
:mod:`porting.cpu`'s shim of Megatron's CUDA-only mask builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from models.llama import LlamaCore
from porting.mcore import moved_to


@dataclass
class MistralCore(LlamaCore):
    """Megatron GPT config for Mistral: the Llama layout plus ``window_size`` (or none)."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.mistral_bridge.MistralModelProvider"

    window_size: tuple[int, int] | None = None
    num_query_groups: int = 8
    ffn_hidden_size: int = 14336
    layernorm_epsilon: float = 1e-5


# checkpoints written before the NeMo classes moved to models.mistral_nemo name them here
__getattr__ = moved_to(__name__, "models.mistral_nemo", "MistralConfig", "MistralModel")
