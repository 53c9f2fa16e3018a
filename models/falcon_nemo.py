"""The Falcon family's NeMo 2.0 classes: :class:`models.falcon.FalconCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTConfig, GPTModel

from models.falcon import FalconCore


@dataclass
class FalconConfig(FalconCore, GPTConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.falcon.FalconCore`."""


class FalconModel(GPTModel):
    """NeMo 2.0 model for the Falcon-style family (a ``GPTModel`` with :class:`FalconConfig`)."""

    def __init__(
        self, config: FalconConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or FalconConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
