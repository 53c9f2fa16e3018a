"""The llama family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: llama3 and YaRN rotary scaling, which its configure_model applies (an unscaled Llama keeps Bridge's own provider).

``run_config.yaml`` names it where needed (``LlamaCore.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.llama import LlamaCore
from porting.mcore import bridge_provider

LlamaModelProvider = bridge_provider(LlamaCore, "LlamaModelProvider", __name__)
