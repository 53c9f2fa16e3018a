"""The Nemotron family's NeMo 2.0 classes: :class:`models.nemotron.NemotronCore` as NeMo's GPT
config (the class a checkpoint's ``context/io.json`` names) and its ``GPTModel`` (porting.mcore).
NeMo's own ``NemotronConfig`` is another class: ours carries the family's spec."""

from __future__ import annotations

from models.llama_nemo import LlamaConfig
from models.nemotron import NemotronCore
from porting.nemo_classes import nemo_classes

NemotronConfig, NemotronModel = nemo_classes(NemotronCore, LlamaConfig, __name__)
