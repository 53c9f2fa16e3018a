"""The tsuzumi family: an in-house product built on the Llama family, as a derived family is.

tsuzumi checkpoints use the Llama layout (tensor names, config fields) under their own
architecture name, ``TsuzumiForCausalLM`` with ``model_type: tsuzumi``; the HF reference side is
``transformers``' Llama. Checkpoints that an earlier porting wrote from a ``LlamaForCausalLM``
directory with ``family: tsuzumi`` in their manifest keep loading and exporting through this
family (tests/test_tsuzumi.py reads one such checkpoint, shipped in tests/data). ``porting convert``
of such a checkpoint re-imports it from the Llama directory it exports, so the result is a
checkpoint of the llama family, which computes the same.
"""

from __future__ import annotations

import dataclasses

from converters import llama
from porting.contract.config_map import Require

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="tsuzumi",
    architectures=("TsuzumiForCausalLM",),
    model_types=("tsuzumi",),
    hf_model_class="LlamaForCausalLM",
    config_entries=(
        *(e for e in llama.CONFIG if getattr(e, "hf", None) != "model_type"),
        Require(
            "model_type",
            lambda v: v in ("tsuzumi", "llama"),
            "the HF side is the Llama layout (llama: checkpoints written before the Llama base)",
        ),
    ),
    config_cls="models.tsuzumi:TsuzumiConfig",
    model_cls="models.tsuzumi:TsuzumiModel",
    summary="NTT's in-house Llama-family decoder: the llama family under its own architecture",
    variants=(llama.FAMILY.variants[0],),
)
