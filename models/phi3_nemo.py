"""The Phi3 family's NeMo 2.0 classes: :class:`models.phi3.Phi3Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.llama_nemo import LlamaConfig
from models.phi3 import Phi3Core


@dataclass
class Phi3Config(Phi3Core, LlamaConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.phi3.Phi3Core`."""


class Phi3Model(GPTModel):
    """NeMo 2.0 model for the Phi-3 family (a ``GPTModel`` with :class:`Phi3Config`)."""

    def __init__(
        self, config: Phi3Config | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or Phi3Config(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
