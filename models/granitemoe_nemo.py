"""The Granite MoE family's NeMo 2.0 classes: :class:`models.granitemoe.GraniteMoeCore` as NeMo's
GPT config (the class a checkpoint's ``context/io.json`` names) and its ``GPTModel``."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.granitemoe import GraniteMoeCore
from models.qwen_nemo import QwenConfig


@dataclass
class GraniteMoeConfig(GraniteMoeCore, QwenConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.granitemoe.GraniteMoeCore`."""


class GraniteMoeModel(GPTModel):
    """NeMo 2.0 model for the Granite MoE family (a ``GPTModel`` with :class:`GraniteMoeConfig`)."""

    def __init__(
        self,
        config: GraniteMoeConfig | None = None,
        optim=None,
        tokenizer=None,
        model_transform=None,
    ):
        super().__init__(
            config or GraniteMoeConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
