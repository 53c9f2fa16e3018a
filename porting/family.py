"""What the engine knows of a model family: its tables, its config classes and its shape context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from porting.convert.config_map import ConfigEntry
from porting.convert.mapping import Entry


@dataclass(frozen=True)
class ShapeContext:
    """Shape facts the mapping transforms and ``when`` predicates read.

    Families with more variant switches subclass it (e.g. Falcon's norm count).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_output: bool
    attention_bias: bool = False
    mlp_bias: bool = False


@dataclass(frozen=True)
class Family:
    """One model family: an HF architecture, its Megatron config/model classes and its tables.

    Attributes:
        name: short family name used in manifests and messages (``tsuzumi``).
        hf_architecture: the ``architectures[0]`` value the registry keys on.
        config_entries: the HF config mapping and lint (:mod:`porting.convert.config_map`).
        weights: the weight mapping table (:mod:`porting.convert.mapping`).
        config_cls: the family's NeMo/Megatron config dataclass.
        model_cls: the family's NeMo ``GPTModel`` subclass.
        shape_context: builds the :class:`ShapeContext` from a Megatron config.
        hf_model_class: the ``transformers`` class name that loads the HF side.
        hf_attn_implementation: the ``transformers`` attention implementation parity runs the HF
            side with; ``"eager"`` unless the family's eager path disagrees with its default one
            (transformers 4.57's eager Falcon adds ALiBi twice; its default, sdpa, once).
    """

    name: str
    hf_architecture: str
    config_entries: tuple[ConfigEntry, ...]
    weights: tuple[Entry, ...]
    config_cls: type
    model_cls: type
    shape_context: Callable[[Any], ShapeContext]
    hf_model_class: str
    hf_attn_implementation: str = "eager"
