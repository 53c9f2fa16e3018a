"""The Falcon-style decoder (TII Falcon, ``FalconForCausalLM``) on Megatron-Core.

Main differences from a Megatron GPT layer (``megatron/core/transformer/transformer_layer.py``),
chosen by the same switches as ``transformers``' ``FalconConfig``:

============================  ===================================================  ==============
variant (HF config)           block                                                attention
============================  ===================================================  ==============
7B  ``multi_query``           ``x + attn(ln(x)) + mlp(ln(x))`` (one shared norm)    MQA, rotary
40B/180B ``new_decoder_...``  ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))``             GQA, rotary
11B ``num_ln_in_...=1``       ``x + attn(ln(x)) + mlp(ln(x))``                      GQA, rotary
RW  ``alibi``                 ``h = x + attn(ln1(x)); h + mlp(ln2(h))`` (stock GPT)  MHA, ALiBi
============================  ===================================================  ==============

Everywhere: LayerNorm with bias, an ungated GELU MLP (``dense_h_to_4h -> gelu -> dense_4h_to_h``),
rotary in the split-halves style over the whole head with base ``rope_theta`` (or ALiBi instead),
optional biases on every linear layer, tied or untied output.

Megatron-Core has no parallel block and no ALiBi: the layers and specs that add them are in
:mod:`models.falcon_spec`; this module is the config over them (its NeMo 2.0 classes:
:mod:`models.falcon_nemo`).

Example (the HF connectors are registered by the converter module, which the registry imports)::

    from nemo.collections import llm
    import converters.falcon  # registers the HF importer/exporter
    from models.falcon_nemo import FalconConfig, FalconModel
    llm.import_ckpt(model=FalconModel(FalconConfig()), source="hf:///path/to/hf-dir")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec

from models.falcon_block import FalconBlock, falcon_block
from models.falcon_spec import (
    HAVE_TE,
    AlibiDotProductAttention,
    FalconParallelLayer,
    alibi_bias,
    alibi_slopes,
    build_falcon_layer_spec,
)
from porting import cpu
from porting.mcore import GPTCore, moved_to

__all__ = [
    "AlibiDotProductAttention",
    "FalconBlock",
    "FalconCore",
    "FalconParallelLayer",
    "alibi_bias",
    "alibi_slopes",
    "build_falcon_layer_spec",
    "falcon_block",
    "falcon_layer_spec",
]


def falcon_layer_spec(config: FalconCore) -> ModuleSpec:
    """The layer spec for ``config``: Transformer Engine modules where TE is installed, else local."""
    return build_falcon_layer_spec(config.block, alibi=config.alibi, use_te=HAVE_TE)


@dataclass
class FalconCore(GPTCore):
    """Megatron GPT config with Falcon's switches, named and defaulted as in ``FalconConfig`` of
    ``transformers`` (defaults: Falcon-7B's block).

    ``new_decoder_architecture``, ``parallel_attn`` and ``num_ln_in_parallel_attn`` choose the block
    (:func:`falcon_block`); ``alibi`` replaces rotary with ALiBi; ``multi_query`` is kept so that
    export writes the same variant back (the attention layout itself is ``num_query_groups``).
    """

    normalization: str = "LayerNorm"
    activation_func: Callable = F.gelu
    gated_linear_unit: bool = False
    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    add_bias_linear: bool = False
    share_embeddings_and_output_weights: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    seq_length: int = 2048
    num_layers: int = 32
    hidden_size: int = 4544
    ffn_hidden_size: int = 18176
    num_attention_heads: int = 71
    num_query_groups: int = 1
    rotary_base: float = 10000.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    # Megatron's fused bias-GELU is the tanh approximation (megatron/core/fusions/fused_bias_gelu.py);
    # Falcon uses the exact erf GELU, so that fusion stays off even on GPUs.
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = True
    persist_layer_norm: bool = True
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True
    transformer_layer_spec: ModuleSpec | Callable = falcon_layer_spec

    new_decoder_architecture: bool = False
    multi_query: bool = True
    parallel_attn: bool = True
    num_ln_in_parallel_attn: int | None = None
    alibi: bool = False
    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.falcon_bridge.FalconModelProvider"

    def __post_init__(self) -> None:
        _ = self.block  # validates the switches before Megatron's own checks
        if not self.new_decoder_architecture:
            # the classic layouts have one KV head (multi_query) or one per query head
            heads = self.num_attention_heads
            expected = 1 if self.multi_query else heads
            if (self.num_query_groups or heads) != expected:
                raise ValueError(
                    f"num_query_groups={self.num_query_groups} contradicts multi_query="
                    f"{self.multi_query} without new_decoder_architecture (expected {expected})"
                )
        if self.alibi:
            # GPTModel knows no ALiBi: no position embedding there, the bias is in core attention
            self.position_embedding_type = "none"
            self.apply_rope_fusion = False
        # TransformerConfig.__post_init__ rejects fusions whose kernels are missing: off first
        # (every CUDA-only one on the CPU; under CUDA those TE / apex would provide).
        cpu.kernel_safe_config(self)
        super().__post_init__()

    @property
    def block(self) -> FalconBlock:
        """The decoder block these switches select."""
        return falcon_block(
            new_decoder_architecture=self.new_decoder_architecture,
            parallel_attn=self.parallel_attn,
            num_ln_in_parallel_attn=self.num_ln_in_parallel_attn,
        )

    def configure_model(self, tokenizer, pre_process=None, post_process=None, vp_stage=None):
        """Build the Megatron-Core GPT model with the Falcon layer spec."""
        from megatron.core.transformer.enums import AttnBackend

        if self.alibi and self.attention_backend == AttnBackend.local:
            # the GPT build (NeMo's or porting.mcore's) swaps in the stock DotProductAttention
            raise ValueError("attention_backend='local' would drop ALiBi; leave it at 'auto'")
        return super().configure_model(tokenizer, pre_process, post_process, vp_stage)


# checkpoints written before the NeMo classes moved to models.falcon_nemo name them here
__getattr__ = moved_to(__name__, "models.falcon_nemo", "FalconConfig", "FalconModel")
