"""The Mistral family's NeMo 2.0 classes: :class:`models.mistral.MistralCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.llama_nemo import LlamaConfig
from models.mistral import MistralCore


@dataclass
class MistralConfig(MistralCore, LlamaConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.mistral.MistralCore`."""


class MistralModel(GPTModel):
    """NeMo 2.0 model for the Mistral family (a ``GPTModel`` with :class:`MistralConfig`)."""

    def __init__(
        self, config: MistralConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or MistralConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
