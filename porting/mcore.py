"""A Megatron-Core GPT config that builds its model without NeMo.

NeMo 2's ``GPTConfig`` (``nemo/collections/llm/gpt/model/base.py``) is the config NeMo trains and
records in a checkpoint's ``context/io.json``, but importing it loads NeMo, Lightning and their
dependencies: 6-8 s of start-up on the CI machine's two cores before ``porting verify`` or
``export`` computes anything. They need only the Megatron-Core model, so each of our families
writes its config twice over one body of fields and maths:

* ``XCore(GPTCore)`` in ``models/x.py``: every field and ``__post_init__``/``configure_model``
  of the family, importing Megatron-Core and torch only. :meth:`GPTCore.configure_model` builds
  ``megatron.core``'s ``GPTModel`` from it.
* ``XConfig(XCore, GPTConfig)`` in ``models/x_nemo.py``: NeMo's class, the one ``io.json`` names.
  Its MRO puts NeMo's ``GPTConfig`` after ``GPTCore``, and :meth:`GPTCore.configure_model` hands
  over to NeMo's own ``configure_model`` when there is one, so training and import build exactly
  as NeMo does.

``Family.core_config_cls`` names the first; the engine builds verification's and export's models
from it (``porting.convert.megatron.build_config``), and ``tests/test_mcore.py`` proves both
classes build the same modules and the same logits for every family.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

try:
    from megatron.core.extensions.transformer_engine import HAVE_TE
except ImportError:
    HAVE_TE = False


def default_layer_spec(config: GPTCore, vp_stage: int | None = None) -> ModuleSpec:
    """Megatron-Core's GPT layer spec for ``config``, chosen as NeMo's ``default_layer_spec``
    chooses it: Transformer Engine's where TE is installed, the local one elsewhere (the CPU)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if HAVE_TE and getattr(config, "use_transformer_engine_full_layer_spec", False):
        # a field of NeMo's GPTConfig only, so NeMo is loaded: its own spec for its own option
        from nemo.collections.llm.gpt.model.base import transformer_engine_full_layer_spec

        return transformer_engine_full_layer_spec(config, vp_stage=vp_stage)
    if HAVE_TE:
        kwargs: dict[str, Any] = {
            "num_experts": config.num_moe_experts,
            "moe_grouped_gemm": config.moe_grouped_gemm,
            "qk_layernorm": config.qk_layernorm,
            "fp8": bool(config.num_moe_experts and config.fp8 is not None),
        }
        if getattr(config, "use_transformer_engine_op_fuser", None) is not None:
            kwargs["use_te_op_fuser"] = config.use_transformer_engine_op_fuser
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )


def block_of(layer: ModuleSpec, final_norm: type, config: GPTCore, vp_stage=None) -> ModuleSpec:
    """A decoder block spec of ``layer`` repeated for the layers this pipeline stage builds, and
    ``final_norm`` after them (a family's custom spec: Megatron-Core's own builders take no
    layer of ours)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=final_norm),
    )


def submodules_of(spec):
    """The ``submodules`` a spec entry builds with: a ``ModuleSpec``'s field, or, where
    Megatron-Core 0.19 writes the entry as ``functools.partial(Module, submodules=...)`` (its MoE
    layer and experts), the partial's keyword."""
    if isinstance(spec, ModuleSpec):
        return spec.submodules
    return spec.keywords["submodules"]


@functools.cache
def _checkpoint_named_mtp_layer() -> type:
    """Megatron-Core 0.19's ``MultiTokenPredictionLayer`` with its decoder layer held as
    ``transformer_layer``, the name checkpoints use (0.19 renamed the attribute
    ``mtp_model_layer`` and maps it back only in its sharded state dict): a model's own parameter
    names are then one set across Megatron-Core versions, for every table and reader that walks
    them."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    class CheckpointNamedMtpLayer(MultiTokenPredictionLayer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._modules["transformer_layer"] = self._modules.pop("mtp_model_layer")

        def __getattr__(self, name: str):
            if name == "mtp_model_layer":
                return self._modules["transformer_layer"]
            return super().__getattr__(name)

    return CheckpointNamedMtpLayer


@dataclass
class GPTCore(TransformerConfig):
    """Megatron-Core's ``TransformerConfig`` plus the GPT model's own fields, named and
    defaulted as NeMo's ``GPTConfig`` has them. Every field NeMo's class re-defaults is here too:
    ``XCore`` comes first in ``XConfig(XCore, GPTConfig)``'s MRO, so its defaults are the ones
    the NeMo class gets."""

    fp16_lm_cross_entropy: bool = False
    parallel_output: bool = True
    share_embeddings_and_output_weights: bool = True
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    seq_len_interpolation_factor: float | None = None
    seq_length: int = 1024
    attention_softmax_in_fp32: bool = False
    masked_softmax_fusion: bool = True
    cross_entropy_loss_fusion: bool = True
    deallocate_pipeline_outputs: bool = True
    # NeMo's rule: on where Apex's fused weight-gradient kernel is installed
    gradient_accumulation_fusion: bool = (
        importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    )
    scatter_embedding_sequence_parallel: bool = True
    vocab_size: int | None = None
    transformer_layer_spec: ModuleSpec | Callable = default_layer_spec

    def configure_model(self, tokenizer=None, pre_process=None, post_process=None, vp_stage=None):
        """The Megatron-Core ``GPTModel`` of this config for the current parallel state.

        A NeMo config (``XConfig(XCore, GPTConfig)``) builds through NeMo's ``configure_model``,
        next in its MRO; a core config builds here, with ``vocab_size`` already padded."""
        nemo_build = getattr(super(), "configure_model", None)
        if nemo_build is not None:
            return nemo_build(tokenizer, pre_process, post_process, vp_stage)
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_model import GPTModel

        if self.vocab_size is None:
            raise ValueError(f"{type(self).__name__}.vocab_size is not set")
        vp_stage = vp_stage or 0
        spec = self._layer_spec(vp_stage)
        mtp = None
        if getattr(self, "mtp_num_layers", None):
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            # a spec of its own: the local-attention swap below must not reach it (as in NeMo)
            mtp = get_gpt_mtp_block_spec(
                self, self._layer_spec(vp_stage), use_transformer_engine=HAVE_TE, vp_stage=vp_stage
            )
            for layer in mtp.layer_specs if mtp is not None else ():
                if "mtp_model_layer" in getattr(layer.submodules, "__dataclass_fields__", {}):
                    layer.module = _checkpoint_named_mtp_layer()
        if self.attention_backend == AttnBackend.local and hasattr(spec, "submodules"):
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            spec.submodules.self_attention.submodules.core_attention = DotProductAttention
        meta = self.init_model_with_meta_device
        with torch.device("meta") if meta else contextlib.nullcontext():
            return GPTModel(
                self,
                transformer_layer_spec=spec,
                vocab_size=self.vocab_size,
                max_sequence_length=self.seq_length,
                fp16_lm_cross_entropy=self.fp16_lm_cross_entropy,
                parallel_output=self.parallel_output,
                share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
                position_embedding_type=self.position_embedding_type,
                rotary_percent=self.rotary_percent,
                rotary_base=self.rotary_base,
                seq_len_interpolation_factor=self.seq_len_interpolation_factor,
                pre_process=pre_process
                or parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=post_process
                or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                scatter_embedding_sequence_parallel=self.scatter_embedding_sequence_parallel,
                vp_stage=vp_stage,
                mtp_block_spec=mtp,
            )

    def _layer_spec(self, vp_stage: int) -> ModuleSpec:
        spec = self.transformer_layer_spec
        if isinstance(spec, ModuleSpec):
            return spec
        if "vp_stage" in inspect.signature(spec).parameters:
            return spec(self, vp_stage=vp_stage)
        return spec(self)


class BridgeProvider:
    """The mixin of a family's own Megatron-Bridge provider (:func:`bridge_provider`).

    Bridge's loader instantiates the provider from ``run_config.yaml`` (every field of the
    family's config) and calls ``provide``: the family's ``configure_model`` then builds the
    Megatron-Core model as verify and export do without NeMo, with the family's layer spec and
    what it adds after the build (an embedding scale, rotary tables)."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        return self.configure_model(None, pre_process, post_process, vp_stage)


def bridge_provider(core: type, name: str, module: str) -> type:
    """A family's own Megatron-Bridge provider class, for a model Bridge's ``GPTModelProvider``
    cannot describe: the dataclass ``name(BridgeProvider, core, GPTModelProvider)``, defined as
    ``module.name`` (the ``run_config.yaml`` target that ``core.megatron_bridge_provider``
    declares, and the one Bridge writes again when it saves). Imports Megatron-Bridge: called
    from a family's ``models/x_bridge.py``, which only the current stack imports."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    doc = f"Bridge's GPT provider with the fields, defaults, checks and build of {core.__name__}."
    namespace = {"__module__": module, "__qualname__": name, "__doc__": doc}
    return dataclass(type(name, (BridgeProvider, core, GPTModelProvider), namespace))


def moved_to(here: str, module: str, *names: str) -> Callable[[str], Any]:
    """Module ``here``'s ``__getattr__``: ``names`` are found in ``module``, imported on first use.

    A family module that held its NeMo classes before they moved to ``models/x_nemo.py`` keeps
    answering for them: checkpoints written before name them there (``context/io.json``), and
    NeMo's loader imports what it names."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(module), name)
        raise AttributeError(f"module {here!r} has no attribute {name!r}")

    # read by the io.json check (porting.convert.context), which must not import NeMo to know it
    __getattr__.moved = dict.fromkeys(names, module)
    return __getattr__
