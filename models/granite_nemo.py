"""The Granite family's NeMo 2.0 classes: :class:`models.granite.GraniteCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.granite import GraniteCore
from models.llama_nemo import LlamaConfig
from porting.nemo_classes import nemo_classes

GraniteConfig, GraniteModel = nemo_classes(GraniteCore, LlamaConfig, __name__)
