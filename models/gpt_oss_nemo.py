"""The GptOss family's NeMo 2.0 classes: :class:`models.gpt_oss.GptOssCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.gpt_oss import GptOssCore
from models.moe_nemo import MoEConfig


@dataclass
class GptOssConfig(GptOssCore, MoEConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.gpt_oss.GptOssCore`."""


class GptOssModel(GPTModel):
    """NeMo 2.0 model for gpt-oss (a ``GPTModel`` with :class:`GptOssConfig`)."""

    def __init__(
        self, config: GptOssConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or GptOssConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
