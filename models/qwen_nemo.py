"""The Qwen family's NeMo 2.0 classes: :class:`models.qwen.QwenCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.llama_nemo import LlamaConfig
from models.qwen import QwenCore


@dataclass
class QwenConfig(QwenCore, LlamaConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.qwen.QwenCore`."""


class QwenModel(GPTModel):
    """NeMo 2.0 model for the Qwen family (a ``GPTModel`` with :class:`QwenConfig`)."""

    def __init__(
        self, config: QwenConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or QwenConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
