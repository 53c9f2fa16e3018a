"""OLMoE on Megatron-Core: the MoE family's layer (:mod:`models.moe`) with OLMo's attention.

The block is GPT's pre-norm one, ``h = x + attention(input_layernorm(x))``,
``y = h + moe(pre_mlp_layernorm(h))``; what differs is inside the attention
(:class:`models.olmo_attention.FullQKNormSelfAttention`: q/k RMSNorm over the whole projection,
then ``clip_qkv``'s clamp of q, k and v), which replaces the spec's ``SelfAttention`` and keeps
its submodules. The MoE layer is upstream's, routed as the MoE family routes Qwen-MoE.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron.core.transformer.spec_utils import ModuleSpec

from models.moe import MoECore, moe_layer_spec
from models.olmo_attention import FullQKNormSelfAttention
from porting.mcore import moved_to


def olmoe_layer_spec(config: OlmoeCore) -> ModuleSpec:
    """The MoE family's layer spec for ``config`` with :class:`FullQKNormSelfAttention`."""
    spec = moe_layer_spec(config)
    attention = dataclasses.replace(spec.submodules.self_attention, module=FullQKNormSelfAttention)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )


@dataclass
class OlmoeCore(MoECore):
    """Megatron GPT config for OLMoE (defaults: OLMoE-1B-7B-0924). ``clip_qkv``: q, k and v
    clamped to ``[-clip_qkv, clip_qkv]`` after the q/k norms; ``None``: no clamp."""

    num_layers: int = 16
    hidden_size: int = 2048
    ffn_hidden_size: int = 1024
    num_attention_heads: int = 16
    num_query_groups: int = 16
    seq_length: int = 4096
    rotary_base: float = 10000.0
    layernorm_epsilon: float = 1e-5
    num_moe_experts: int = 64
    moe_router_topk: int = 8
    moe_ffn_hidden_size: int = 1024
    moe_router_pre_softmax: bool = True
    moe_aux_loss_coeff: float = 0.01
    hf_mlp_layout: str = field(default="qwen", metadata={"megatron": False})
    clip_qkv: float | None = None
    transformer_layer_spec: ModuleSpec | object = olmoe_layer_spec


# checkpoints written before the NeMo classes moved to models.olmoe_nemo name them here
__getattr__ = moved_to(__name__, "models.olmoe_nemo", "OlmoeConfig", "OlmoeModel")
