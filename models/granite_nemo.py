"""The Granite family's NeMo 2.0 classes: :class:`models.granite.GraniteCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.granite import GraniteCore
from models.llama_nemo import LlamaConfig


@dataclass
class GraniteConfig(GraniteCore, LlamaConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.granite.GraniteCore`."""


class GraniteModel(GPTModel):
    """NeMo 2.0 model for the Granite family (a ``GPTModel`` with :class:`GraniteConfig`)."""

    def __init__(
        self, config: GraniteConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or GraniteConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
