"""The falcon family's own Megatron-Bridge provider, for what Bridge's ``GPTModelProvider``
cannot hold: Bridge has no Falcon: the parallel block and ALiBi (the family's layer spec).

``run_config.yaml`` names it where needed (``FalconCore.megatron_bridge_provider``,
porting.convert.bridge); Bridge's loader builds the model from it once the ``models.`` prefix is
registered (docs/formats.md). Imports Megatron-Bridge: only the current stack imports this module.
"""

from models.falcon import FalconCore
from porting.mcore import bridge_provider

FalconModelProvider = bridge_provider(FalconCore, "FalconModelProvider", __name__)
