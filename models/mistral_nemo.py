"""The Mistral family's NeMo 2.0 classes: :class:`models.mistral.MistralCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.llama_nemo import LlamaConfig
from models.mistral import MistralCore
from porting.nemo_classes import nemo_classes

MistralConfig, MistralModel = nemo_classes(MistralCore, LlamaConfig, __name__)
