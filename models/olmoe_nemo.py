"""The Olmoe family's NeMo 2.0 classes: :class:`models.olmoe.OlmoeCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.moe_nemo import MoEConfig
from models.olmoe import OlmoeCore
from porting.nemo_classes import nemo_classes

OlmoeConfig, OlmoeModel = nemo_classes(OlmoeCore, MoEConfig, __name__)
