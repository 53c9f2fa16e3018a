"""The deepseek-v2 family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: multi-latent attention and the MoE with its shared experts and softmax router
(:mod:`models.deepseek_bridge` for DeepSeek-V3's).

``run_config.yaml`` names it (``DeepseekV2Core.megatron_bridge_provider``, porting.convert.bridge);
Bridge's loader builds the model from it once the ``models.`` prefix is registered
(docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.deepseek_v2 import DeepseekV2Core
from porting.mcore import bridge_provider

DeepseekV2ModelProvider = bridge_provider(DeepseekV2Core, "DeepseekV2ModelProvider", __name__)
