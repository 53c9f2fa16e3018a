"""The Deepseek family's NeMo 2.0 classes: :class:`models.deepseek.DeepseekCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.deepseek import DeepseekCore
from models.moe_nemo import MoEConfig


@dataclass
class DeepseekConfig(DeepseekCore, MoEConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.deepseek.DeepseekCore`."""


class DeepseekModel(GPTModel):
    """NeMo 2.0 model for the DeepSeek family (a ``GPTModel`` with :class:`DeepseekConfig`)."""

    def __init__(
        self, config: DeepseekConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or DeepseekConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
