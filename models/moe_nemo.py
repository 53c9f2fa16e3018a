"""The MoE family's NeMo 2.0 classes: :class:`models.moe.MoECore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.moe import MoECore
from models.qwen_nemo import QwenConfig
from porting.nemo_classes import nemo_classes

MoEConfig, MoEModel = nemo_classes(MoECore, QwenConfig, __name__)
