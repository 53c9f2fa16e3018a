"""The Nemotron family's NeMo 2.0 classes: :class:`models.nemotron.NemotronCore` as NeMo's GPT
config (the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore).
NeMo's own ``NemotronConfig`` is another class: ours carries the family's spec."""

from __future__ import annotations

from dataclasses import dataclass

from nemo.collections.llm.gpt.model.base import GPTModel

from models.llama_nemo import LlamaConfig
from models.nemotron import NemotronCore


@dataclass
class NemotronConfig(NemotronCore, LlamaConfig):
    """NeMo's GPT config with the fields and maths of :class:`models.nemotron.NemotronCore`."""


class NemotronModel(GPTModel):
    """NeMo 2.0 model for the Nemotron family (a ``GPTModel`` with :class:`NemotronConfig`)."""

    def __init__(
        self,
        config: NemotronConfig | None = None,
        optim=None,
        tokenizer=None,
        model_transform=None,
    ):
        super().__init__(
            config or NemotronConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
