"""The smollm3 family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: rotary scaling, as Llama's (an unscaled SmolLM3 keeps Bridge's own provider, which
has ``no_rope_freq`` and the window fields).

``run_config.yaml`` names it where needed (``SmolLM3Core.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.smollm3 import SmolLM3Core
from porting.mcore import bridge_provider

SmolLM3ModelProvider = bridge_provider(SmolLM3Core, "SmolLM3ModelProvider", __name__)
