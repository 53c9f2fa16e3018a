"""The Llama family's NeMo 2.0 classes: :class:`models.llama.LlamaCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTConfig, GPTModel

from models.llama import LlamaCore


@dataclass
class LlamaConfig(LlamaCore, GPTConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.llama.LlamaCore`."""


class LlamaModel(GPTModel):
    """NeMo 2.0 model of the Llama family (a ``GPTModel`` with :class:`LlamaConfig`)."""

    def __init__(
        self, config: LlamaConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or LlamaConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
