"""The Gemma family's NeMo 2.0 classes: :class:`models.gemma.GemmaCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from nemo.collections.llm.gpt.model.base import GPTConfig

from models.gemma import GemmaCore
from porting.nemo_classes import nemo_classes

GemmaConfig, GemmaModel = nemo_classes(GemmaCore, GPTConfig, __name__)
