"""The MoE family's NeMo 2.0 classes: :class:`models.moe.MoECore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.moe import MoECore
from models.qwen_nemo import QwenConfig


@dataclass
class MoEConfig(MoECore, QwenConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.moe.MoECore`."""


class MoEModel(GPTModel):
    """NeMo 2.0 model for the MoE family (a ``GPTModel`` with :class:`MoEConfig`)."""

    def __init__(
        self, config: MoEConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or MoEConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
