"""The DeepSeek-V3 decoder (Kimi K2, Moonlight) on Megatron-Core's multi-latent attention and MoE
layers (:mod:`converters.deepseek`).

Every layer is ``MLASelfAttention`` (low-rank queries, one normed key/value latent, a rotary slice
shared by all heads' keys, plain or YaRN rotary) and then a dense SwiGLU MLP for the first
``first_k_dense_replace`` layers, a ``MoELayer`` for the rest (``moe_layer_freq`` as a per-layer
list). Routing is transformers' ``DeepseekV3TopkRouter``: sigmoid scores, the expert bias added for
the choice only, the top ``topk_group`` of ``n_group`` groups (each scored by its best two
experts), the top-k of those, renormalised and times ``routed_scaling_factor``; the shared
expert's output is added ungated. Experts are one module each (``SequentialMLP``,
``moe_grouped_gemm=False``) and weighted after the expert, as transformers does.

One reading differs by data, not by config, under transformers 4.57: it fills the experts of
unchosen groups with a score of 0, Megatron-Core with -inf (as DeepSeek's own inference code does,
its ``Gate``, and transformers 5), so the two agree while at least ``num_experts_per_tok``
experts of the chosen groups score above 0 (sigmoid plus ``e_score_correction_bias``): for every
token wherever no bias is negative, and otherwise as the parity gate's prompts show. With biases drawn around 0 at DeepSeek-V3's widths
(scripts/bench_scale.py), the gate failed against transformers at the first MoE layer.

The block spec is Megatron-Core's local one (Transformer Engine or not): its MLA keeps the query
and key/value latent norms as modules (``q_layernorm``, ``kv_layernorm``), which the weight table
names, and builds them here with transformers' fixed 1e-6 epsilon (:class:`LatentRMSNorm`), where
Transformer Engine's spec fuses them into the up-projections at the config's ``rms_norm_eps``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import MLATransformerConfig

from models.moe import MoECore
from porting.mcore import moved_to

# transformers' DeepseekV3RMSNorm(q_lora_rank) and (kv_lora_rank): built without the config's eps
LATENT_NORM_EPS = 1e-6


class LatentRMSNorm:
    """The RMSNorm of the query and key/value latents: transformers builds ``q_a_layernorm`` and
    ``kv_a_layernorm`` with their default epsilon (1e-6), not the config's ``rms_norm_eps``
    (Moonlight's is 1e-5)."""

    def __new__(cls, config, hidden_size: int, eps: float | None = None):
        # ``eps``: the config's, which MLA passes and transformers does not use here
        return WrappedTorchNorm(config, hidden_size, eps=LATENT_NORM_EPS)


class LatentDotProductAttention(DotProductAttention):
    """Megatron-Core's local ``DotProductAttention`` taking MLA's ``k_channels`` / ``v_channels``.

    Its maths already allows query/key heads (``qk_head_dim + qk_pos_emb_head_dim``) wider than
    value heads (``v_head_dim``); only its output width assumes one head width
    (``kv_channels``), and its constructor takes no per-tensor widths, which
    ``MultiLatentAttention`` passes (upstream's local spec builds MLA with this class and fails).
    ``Attention.__init__`` first builds one without them, which MLA then replaces.
    """

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kw):
        super().__init__(*args, **kw)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


class LatentSelfAttention(MLASelfAttention):
    """``MLASelfAttention`` built from the modules its spec names.

    Megatron-Core 0.19 re-resolves the q/kv projections and norms against the config's backend
    (``transformer_impl``, Transformer Engine by default, whether installed or not) and, without a
    query latent, wants the query projection fused with a norm that DeepSeek's ``q_proj`` does not
    have. This spec is the local one and says what to build: a plain ``linear_q_proj`` without a
    query latent, the latent norms as modules (0.15 built them so; there is nothing to resolve)."""

    def _resolve_qk_norm_config(self, submodules) -> dict:
        return {
            "linear_q_proj": submodules.linear_q_proj or ColumnParallelLinear,
            "linear_q_up_proj": submodules.linear_q_up_proj or ColumnParallelLinear,
            "linear_kv_up_proj": submodules.linear_kv_up_proj or ColumnParallelLinear,
            "q_layernorm": submodules.q_layernorm or IdentityOp,
            "kv_layernorm": submodules.kv_layernorm or IdentityOp,
        }


def deepseek_block_spec(config: DeepseekCore):
    """Megatron-Core's local GPT block spec for ``config`` (dense first layers, MoE after), with
    every layer's MLA on :class:`LatentDotProductAttention` and its latent norms at transformers'
    epsilon."""
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.module = LatentSelfAttention
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = LatentDotProductAttention
        # no query latent, no query norm
        attention.q_layernorm = (
            IdentityOp if config.q_lora_rank is None else ModuleSpec(module=LatentRMSNorm)
        )
        attention.kv_layernorm = ModuleSpec(module=LatentRMSNorm)
    return spec


@dataclass
class DeepseekCore(MoECore, MLATransformerConfig):
    """Megatron GPT config for the DeepSeek family (defaults: DeepSeek-V3's shapes, unscaled
    rotary; the converter sets every field a checkpoint decides)."""

    # the family's own Megatron-Bridge provider (Bridge's GPTModelProvider has no MLA)
    megatron_bridge_provider: ClassVar[str] = "models.deepseek_bridge.DeepseekModelProvider"

    multi_latent_attention: bool = True
    qk_layernorm: bool = True  # the local MLA spec builds the latent norms only then
    num_layers: int = 61
    hidden_size: int = 7168
    ffn_hidden_size: int = 18432
    num_attention_heads: int = 128
    num_query_groups: int = 128
    kv_channels: int = 192
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rotary_base: float = 10000.0
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    layernorm_epsilon: float = 1e-6
    num_moe_experts: int = 256
    moe_ffn_hidden_size: int = 2048
    moe_shared_expert_intermediate_size: int | None = 2048
    moe_router_topk: int = 8
    moe_router_num_groups: int | None = 8
    moe_router_group_topk: int | None = 4
    moe_router_topk_scaling_factor: float | None = 2.5
    moe_router_score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    moe_layer_freq: int | list[int] = field(default_factory=lambda: [0] * 3 + [1] * 58)
    moe_router_load_balancing_type: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = 0.001
    moe_shared_expert_overlap: bool = False
    apply_rope_fusion: bool = False
    transformer_layer_spec: ModuleSpec | object = deepseek_block_spec


# checkpoints written before the NeMo classes moved to models.deepseek_nemo name them here
__getattr__ = moved_to(__name__, "models.deepseek_nemo", "DeepseekConfig", "DeepseekModel")
