"""The Qwen family's NeMo 2.0 classes: :class:`models.qwen.QwenCore` as NeMo's GPT config
(the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore)."""

from __future__ import annotations

from models.llama_nemo import LlamaConfig
from models.qwen import QwenCore
from porting.nemo_classes import nemo_classes

QwenConfig, QwenModel = nemo_classes(QwenCore, LlamaConfig, __name__)
