"""Megatron-Bridge's layout: Megatron-LM's (Bridge writes the same tracker and common state) plus
``iter_NNNNNNN/run_config.yaml`` (the model provider's fields) and ``train_state.pt``, with
``latest_train_state.pt`` beside the iterations (``megatron/bridge/training/checkpointing.py``).

What those files hold, and how a ``run_config.yaml`` is read without running it, is
:mod:`porting.convert.bridge`.
"""

from __future__ import annotations

from pathlib import Path

from porting.convert.bridge import RUN_CONFIG, check_run_config, run_config_for, write_bridge_files
from porting.convert.layouts.base import Located
from porting.convert.layouts.megatron_lm import ITERATION, MegatronLM, iteration_dir
from porting.convert.manifest import Manifest


class MegatronBridge(MegatronLM):
    """``--format megatron-bridge``."""

    name = "megatron-bridge"
    title = "Megatron-Bridge"
    looks = f"a Megatron-Bridge one also {RUN_CONFIG} in its iteration"

    def owns(self, weights: Path) -> bool:
        return not super().owns(weights)

    def check_saved(self, loc: Located, family=None) -> None:
        super().check_saved(loc, family)
        check_run_config(loc.weights / RUN_CONFIG, loc.root, family)

    def saved_config(self, loc: Located, family=None) -> tuple[dict, str]:
        model = check_run_config(loc.weights / RUN_CONFIG, loc.root, family)
        return model, f"{loc.weights / RUN_CONFIG} (model)"

    def check_config(self, config, family) -> None:
        run_config_for(config, family)

    def common_args(self, config, manifest: Manifest):
        """Megatron-LM's arguments too, for a Megatron-LM run reading this layout; none where
        they cannot describe the model (a rotary scaling, which only ``run_config.yaml`` holds):
        Bridge's loader reads ``run_config.yaml``, and Bridge's own saves hold no arguments."""
        if getattr(config, "rope_scaling_type", None) is not None:
            return None
        return super().common_args(config, manifest)

    def write(self, out: Path, config, manifest: Manifest, family) -> None:
        # A config Bridge's provider cannot describe is refused before anything is moved.
        run_config = run_config_for(config, family)
        super().write(out, config, manifest, family)
        write_bridge_files(out, iteration_dir(out, ITERATION), ITERATION, run_config)


MEGATRON_BRIDGE = MegatronBridge()
