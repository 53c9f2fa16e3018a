"""The gemma family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: the embedding scale and the final soft-cap its configure_model adds; Gemma 2's sandwich norms and soft-capped attention (the family's spec).

``run_config.yaml`` names it where needed (``GemmaCore.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.gemma import GemmaCore
from porting.mcore import bridge_provider

GemmaModelProvider = bridge_provider(GemmaCore, "GemmaModelProvider", __name__)
