"""The mistral family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: rotary scaling, as Llama's (an unscaled Mistral keeps Bridge's own provider).

``run_config.yaml`` names it where needed (``MistralCore.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.mistral import MistralCore
from porting.mcore import bridge_provider

MistralModelProvider = bridge_provider(MistralCore, "MistralModelProvider", __name__)
