"""The llama4 family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: Llama 4's attention (chunked on some layers, a temperature on the rotary-free ones,
the L2 q/k norm on the rotary ones) and its experts weighing their input.

``run_config.yaml`` names it (``Llama4Core.megatron_bridge_provider``, porting.convert.bridge);
Bridge's loader builds the model from it once the ``models.`` prefix is registered
(docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.llama4 import Llama4Core
from porting.mcore import bridge_provider

Llama4ModelProvider = bridge_provider(Llama4Core, "Llama4ModelProvider", __name__)
