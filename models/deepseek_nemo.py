"""The Deepseek family's NeMo 2.0 classes: :class:`models.deepseek.DeepseekCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.deepseek import DeepseekCore
from models.moe_nemo import MoEConfig
from porting.nemo_classes import nemo_classes

DeepseekConfig, DeepseekModel = nemo_classes(DeepseekCore, MoEConfig, __name__)
