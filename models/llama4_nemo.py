"""The Llama 4 family's NeMo 2.0 classes: :class:`models.llama4.Llama4Core` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.llama4 import Llama4Core
from models.moe_nemo import MoEConfig
from porting.nemo_classes import nemo_classes

Llama4Config, Llama4Model = nemo_classes(Llama4Core, MoEConfig, __name__)
