"""The Granite MoE family's NeMo 2.0 classes: :class:`models.granitemoe.GraniteMoeCore` as NeMo's
GPT config (the class a checkpoint's ``context/io.json`` names) and its ``GPTModel``."""

from __future__ import annotations

from models.granitemoe import GraniteMoeCore
from models.qwen_nemo import QwenConfig
from porting.nemo_classes import nemo_classes

GraniteMoeConfig, GraniteMoeModel = nemo_classes(GraniteMoeCore, QwenConfig, __name__)
