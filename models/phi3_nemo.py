"""The Phi3 family's NeMo 2.0 classes: :class:`models.phi3.Phi3Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.llama_nemo import LlamaConfig
from models.phi3 import Phi3Core
from porting.nemo_classes import nemo_classes

Phi3Config, Phi3Model = nemo_classes(Phi3Core, LlamaConfig, __name__)
