"""The DeepSeek-V2 family's NeMo 2.0 classes: :class:`models.deepseek_v2.DeepseekV2Core` as NeMo's
GPT config (the class a checkpoint's ``context/io.json`` names) and its ``GPTModel``
(porting.mcore)."""

from __future__ import annotations

from models.deepseek_v2 import DeepseekV2Core
from models.moe_nemo import MoEConfig
from porting.nemo_classes import nemo_classes

DeepseekV2Config, DeepseekV2Model = nemo_classes(DeepseekV2Core, MoEConfig, __name__)
