"""The Olmoe family's NeMo 2.0 classes: :class:`models.olmoe.OlmoeCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.moe_nemo import MoEConfig
from models.olmoe import OlmoeCore


@dataclass
class OlmoeConfig(OlmoeCore, MoEConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.olmoe.OlmoeCore`."""


class OlmoeModel(GPTModel):
    """NeMo 2.0 model for the OLMoE family (a ``GPTModel`` with :class:`OlmoeConfig`)."""

    def __init__(
        self, config: OlmoeConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or OlmoeConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
