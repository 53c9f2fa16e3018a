"""The Llama family's NeMo 2.0 classes: :class:`models.llama.LlamaCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from nemo.collections.llm.gpt.model.base import GPTConfig

from models.llama import LlamaCore
from porting.nemo_classes import nemo_classes

LlamaConfig, LlamaModel = nemo_classes(LlamaCore, GPTConfig, __name__)
