"""The Falcon family's NeMo 2.0 classes: :class:`models.falcon.FalconCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from nemo.collections.llm.gpt.model.base import GPTConfig

from models.falcon import FalconCore
from porting.nemo_classes import nemo_classes

FalconConfig, FalconModel = nemo_classes(FalconCore, GPTConfig, __name__)
