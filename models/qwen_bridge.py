"""The qwen family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: rotary scaling, as Llama's (an unscaled Qwen keeps Bridge's own provider).

``run_config.yaml`` names it where needed (``QwenCore.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.qwen import QwenCore
from porting.mcore import bridge_provider

QwenModelProvider = bridge_provider(QwenCore, "QwenModelProvider", __name__)
