"""The SmolLM3 family's NeMo 2.0 classes: :class:`models.smollm3.SmolLM3Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.llama_nemo import LlamaConfig
from models.smollm3 import SmolLM3Core


@dataclass
class SmolLM3Config(SmolLM3Core, LlamaConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.smollm3.SmolLM3Core`."""


class SmolLM3Model(GPTModel):
    """NeMo 2.0 model for the SmolLM3 family (a ``GPTModel`` with :class:`SmolLM3Config`)."""

    def __init__(
        self, config: SmolLM3Config | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or SmolLM3Config(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
