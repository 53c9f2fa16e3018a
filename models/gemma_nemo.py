"""The Gemma family's NeMo 2.0 classes: :class:`models.gemma.GemmaCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTConfig, GPTModel

from models.gemma import GemmaCore


@dataclass
class GemmaConfig(GemmaCore, GPTConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.gemma.GemmaCore`."""


class GemmaModel(GPTModel):
    """NeMo 2.0 model for the Gemma family (a ``GPTModel`` with :class:`GemmaConfig`)."""

    def __init__(
        self, config: GemmaConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or GemmaConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
