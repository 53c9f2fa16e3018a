"""The deepseek family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: multi-latent attention (the family's MLA config and spec: the query and key-value latents and their norms), the MoE with its shared experts and scored router, multi-token prediction.

``run_config.yaml`` names it (``DeepseekCore.megatron_bridge_provider``, porting.convert.bridge);
Bridge's loader builds the model from it once the ``models.`` prefix is registered
(docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.deepseek import DeepseekCore
from porting.mcore import bridge_provider

DeepseekModelProvider = bridge_provider(DeepseekCore, "DeepseekModelProvider", __name__)
