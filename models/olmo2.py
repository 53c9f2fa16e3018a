"""OLMo 2 on a custom Megatron-Core spec.

The block equation (``transformers`` 4.57, ``Olmo2DecoderLayer``), with no norm before either
sublayer::

    h = x + post_attention_layernorm(attention(x))
    y = h + post_feedforward_layernorm(mlp(h))

where GPT's is ``h = x + attention(input_layernorm(x))``, ``y = h + mlp(pre_mlp_layernorm(h))``.
The two norms sit on the output of ``linear_proj`` / ``linear_fc2``, before the residual add, so
they live inside those modules as ``post_layernorm`` (the place Gemma 2's sandwich norms have in
:mod:`models.gemma_spec`, with OLMo's plain-``w`` RMSNorm in place of Gemma's ``1 + w``); the
attention norms q and k over the whole projection (:mod:`models.olmo_attention`). Local modules on
every device: Transformer Engine's fused norm+linear has no place in a post-norm layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from models.llama import LlamaCore
from models.olmo_attention import FullQKNormSelfAttention, RMSNorm
from porting.mcore import block_of, moved_to


class PostNormRowParallelLinear(RowParallelLinear):
    """A row-parallel linear layer whose (reduced) output is normed by :class:`RMSNorm`: OLMo 2's
    norm after attention (in ``linear_proj``) and after the MLP (in ``linear_fc2``)."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = RMSNorm(config, output_size, config.layernorm_epsilon)

    def forward(self, input_: torch.Tensor):
        """``(post_layernorm(x W^T), bias)``; OLMo 2 has no linear biases."""
        output, bias = super().forward(input_)
        return self.post_layernorm(output), bias


def olmo2_block_spec(config: Olmo2Core, vp_stage=None) -> ModuleSpec:
    """The decoder block spec: post-norm layers with full-width q/k norms, and a final norm."""
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=FullQKNormSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=PostNormRowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=PostNormRowParallelLinear
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return block_of(layer, RMSNorm, config, vp_stage)


@dataclass
class Olmo2Core(LlamaCore):
    """Megatron GPT config for OLMo 2 (defaults: OLMo-2-1124-7B); the Llama fields, rotary
    scaling included, on :func:`olmo2_block_spec`."""

    num_layers: int = 32
    hidden_size: int = 4096
    ffn_hidden_size: int = 11008
    num_attention_heads: int = 32
    num_query_groups: int = 32
    seq_length: int = 4096
    rotary_base: float = 500000.0
    layernorm_epsilon: float = 1e-6
    transformer_layer_spec: ModuleSpec | Callable = olmo2_block_spec


# checkpoints written before the NeMo classes moved to models.olmo2_nemo name them here
__getattr__ = moved_to(__name__, "models.olmo2_nemo", "Olmo2Config", "Olmo2Model")
