"""The Falcon family's Megatron-Bridge model provider: :class:`models.falcon.FalconCore` over
Bridge's ``GPTModelProvider``, as :mod:`models.falcon_nemo` puts it over NeMo's ``GPTConfig``.

Bridge has no Falcon: its loader builds a model by instantiating the provider a checkpoint's
``run_config.yaml`` names, and for our Falcon checkpoints that is this class (the parallel block
and ALiBi come from the family's layer spec, which ``provide`` calls with the provider). A user
loading such a checkpoint in Bridge registers this package's prefix first, as for any provider
outside Bridge (``megatron.bridge.utils.instantiate_utils.register_allowed_target_prefix("models.")``;
docs/formats.md). This module imports Megatron-Bridge, so only the current stack imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.bridge.models.gpt_provider import GPTModelProvider

from models.falcon import FalconCore


@dataclass
class FalconModelProvider(FalconCore, GPTModelProvider):
    """Bridge's GPT provider with the fields, defaults and checks of :class:`FalconCore`."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        """Bridge's GPT build with the Falcon layer spec (the config's own)."""
        self.check_backend()
        return super().provide(pre_process, post_process, vp_stage)
