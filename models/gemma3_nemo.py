"""The Gemma3 family's NeMo 2.0 classes: :class:`models.gemma3.Gemma3Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.gemma3 import Gemma3Core
from models.gemma_nemo import GemmaConfig
from porting.nemo_classes import nemo_classes

Gemma3Config, Gemma3Model = nemo_classes(Gemma3Core, GemmaConfig, __name__)
