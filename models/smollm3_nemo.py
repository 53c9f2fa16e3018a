"""The SmolLM3 family's NeMo 2.0 classes: :class:`models.smollm3.SmolLM3Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.llama_nemo import LlamaConfig
from models.smollm3 import SmolLM3Core
from porting.nemo_classes import nemo_classes

SmolLM3Config, SmolLM3Model = nemo_classes(SmolLM3Core, LlamaConfig, __name__)
