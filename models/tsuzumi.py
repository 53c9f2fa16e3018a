"""The tsuzumi-style decoder: NTT's in-house Llama-family model, the Llama base under its own names.

Its own classes, so that NeMo finds the tsuzumi family's connectors through them and checkpoints
written as ``models.tsuzumi.TsuzumiConfig`` / ``TsuzumiModel`` (before the Llama base was split
out) keep loading; everything they compute is :mod:`models.llama`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.llama_nemo import LlamaConfig, LlamaModel


@dataclass
class TsuzumiConfig(LlamaConfig):
    """Megatron GPT config of the tsuzumi family (the Llama family's, unchanged)."""


class TsuzumiModel(LlamaModel):
    """NeMo 2.0 model of the tsuzumi family."""

    def __init__(self, config=None, optim=None, tokenizer=None, model_transform=None):
        super().__init__(
            config or TsuzumiConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
