"""The phi3 family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: LongRoPE's two rotary tables and its attention factor.

``run_config.yaml`` names it where needed (``Phi3Core.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.phi3 import Phi3Core
from porting.mcore import bridge_provider

Phi3ModelProvider = bridge_provider(Phi3Core, "Phi3ModelProvider", __name__)
