"""The gemma3 family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: Gemma's additions and the local and global rotary tables its configure_model adds.

``run_config.yaml`` names it where needed (``Gemma3Core.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.gemma3 import Gemma3Core
from porting.mcore import bridge_provider

Gemma3ModelProvider = bridge_provider(Gemma3Core, "Gemma3ModelProvider", __name__)
