"""The Olmo2 family's NeMo 2.0 classes: :class:`models.olmo2.Olmo2Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.llama_nemo import LlamaConfig
from models.olmo2 import Olmo2Core


@dataclass
class Olmo2Config(Olmo2Core, LlamaConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.olmo2.Olmo2Core`."""


class Olmo2Model(GPTModel):
    """NeMo 2.0 model for the OLMo 2 family (a ``GPTModel`` with :class:`Olmo2Config`)."""

    def __init__(
        self, config: Olmo2Config | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or Olmo2Config(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
