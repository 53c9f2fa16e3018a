"""The Olmo2 family's NeMo 2.0 classes: :class:`models.olmo2.Olmo2Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.llama_nemo import LlamaConfig
from models.olmo2 import Olmo2Core
from porting.nemo_classes import nemo_classes

Olmo2Config, Olmo2Model = nemo_classes(Olmo2Core, LlamaConfig, __name__)
