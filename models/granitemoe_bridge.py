"""The granitemoe family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: Granite's multipliers (models.granite.add_multipliers).

``run_config.yaml`` names it (``GraniteMoeCore.megatron_bridge_provider``, porting.convert.bridge);
Bridge's loader builds the model from it once the ``models.`` prefix is registered
(docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.granitemoe import GraniteMoeCore
from porting.mcore import bridge_provider

GraniteMoeModelProvider = bridge_provider(GraniteMoeCore, "GraniteMoeModelProvider", __name__)
