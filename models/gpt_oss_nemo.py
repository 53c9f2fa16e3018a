"""The GptOss family's NeMo 2.0 classes: :class:`models.gpt_oss.GptOssCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.gpt_oss import GptOssCore
from models.moe_nemo import MoEConfig
from porting.nemo_classes import nemo_classes

GptOssConfig, GptOssModel = nemo_classes(GptOssCore, MoEConfig, __name__)
