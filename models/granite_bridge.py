"""The granite family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: the embedding, residual and logit multipliers its configure_model adds.

``run_config.yaml`` names it (``GraniteCore.megatron_bridge_provider``, porting.convert.bridge);
Bridge's loader builds the model from it once the ``models.`` prefix is registered
(docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.granite import GraniteCore
from porting.mcore import bridge_provider

GraniteModelProvider = bridge_provider(GraniteCore, "GraniteModelProvider", __name__)
