"""The gpt_oss family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: YaRN rotary scaling (every gpt-oss release), which its configure_model applies, with the attention sinks and the clamped SwiGLU of the family's spec.

``run_config.yaml`` names it where needed (``GptOssCore.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.gpt_oss import GptOssCore
from porting.mcore import bridge_provider

GptOssModelProvider = bridge_provider(GptOssCore, "GptOssModelProvider", __name__)
