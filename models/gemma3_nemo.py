"""The Gemma3 family's NeMo 2.0 classes: :class:`models.gemma3.Gemma3Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.gemma3 import Gemma3Core
from models.gemma_nemo import GemmaConfig


@dataclass
class Gemma3Config(Gemma3Core, GemmaConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.gemma3.Gemma3Core`."""


class Gemma3Model(GPTModel):
    """NeMo 2.0 model for the Gemma 3 family (a ``GPTModel`` with :class:`Gemma3Config`)."""

    def __init__(
        self, config: Gemma3Config | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or Gemma3Config(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
