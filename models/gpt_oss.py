"""gpt-oss on Megatron-Core's MoE layer (the stock layer spec, config knobs only).

Block equation, per layer: ``h = x + o(attn(norm(x)))`` with ``attn`` a GQA softmax over the
scores and one learnable sink logit per head (the sink's probability is dropped: Megatron's
``softmax_type="learnable"``, ``SoftmaxOne`` with the core attention's ``softmax_offset``), on a
window of ``sliding_window`` keys in the layers ``layer_types`` names sliding
(``window_attn_skip_freq`` as a per-layer list); then ``h + sum_k p_k E_k(norm(h))`` with ``p``
the softmax of the top-k biased router logits and each expert
``E(y) = W2 ((clamp(u, -7, 7) + 1) * quick_gelu(clamp(g, max=7))) + b2``, ``[g; u] = W1 y + b1``.
Differences from :class:`models.moe.MoECore`'s Mixtral: every linear biased
(``add_bias_linear``: q/k/v, o, router, experts), the sinks, the clamped and offset GLU
(``activation_func_clamp_value``, ``glu_linear_offset``), YaRN (:class:`models.llama.LlamaCore`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size

from models.moe import MoECore, moe_layer_spec
from porting.mcore import moved_to, submodules_of


class ExpertRowParallelLinear(RowParallelLinear):
    """An expert's ``linear_fc2`` whose bias counts once under expert tensor parallelism.

    An expert's row-parallel output is summed over the expert-TP ranks by the token dispatcher's
    combine, after ``MLP.forward`` has added the whole bias on every rank
    (megatron/core/transformer/mlp.py, ``output += output_bias * per_token_scale``), so upstream
    counts the bias once per rank. Each rank hands out ``bias / ranks`` instead, so that the ranks'
    sum counts it once. At 2 ranks that is exact (``b / 2`` is exact and ``b / 2 + b / 2 == b``);
    at more, ``b / ranks`` is still exact for a power of two, but the combine adds the shares one
    after another and a partial sum such as ``3 * b / 4`` can round: the bias comes back up to
    rounding, as the split matmul's partial sums do. Unchanged at one rank.
    """

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        ranks = get_pg_size(self.tp_group) if self.explicit_expert_comm else 1
        if bias is not None and ranks > 1:
            bias = bias / ranks
        return output, bias


def gpt_oss_layer_spec(config: GptOssCore) -> ModuleSpec:
    """The MoE family's layer spec with the experts' ``linear_fc2`` biased once per token under
    expert tensor parallelism (:class:`ExpertRowParallelLinear`)."""
    spec = moe_layer_spec(config)
    experts = submodules_of(submodules_of(spec.submodules.mlp).experts)
    if experts.linear_fc2 is RowParallelLinear:
        experts.linear_fc2 = ExpertRowParallelLinear
    elif (config.expert_tensor_parallel_size or config.tensor_model_parallel_size) > 1:
        raise ValueError(
            f"expert tensor parallelism with {experts.linear_fc2.__name__} experts would add "
            "each expert's output bias once per rank; run experts at expert_tensor_parallel_size=1"
        )
    return spec


@dataclass
class GptOssCore(MoECore):
    """Megatron GPT config for gpt-oss (defaults: gpt-oss-20b's)."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.gpt_oss_bridge.GptOssModelProvider"

    num_layers: int = 24
    hidden_size: int = 2880
    ffn_hidden_size: int = 2880
    num_attention_heads: int = 64
    num_query_groups: int = 8
    kv_channels: int | None = 64
    num_moe_experts: int = 32
    moe_router_topk: int = 4
    moe_ffn_hidden_size: int = 2880
    moe_aux_loss_coeff: float = 0.9
    rotary_base: float = 150000.0
    layernorm_epsilon: float = 1e-5
    add_bias_linear: bool = True
    softmax_type: str = "learnable"
    # GptOssExperts: gate * sigmoid(1.702 gate) is quick_gelu; (up + 1) is the offset
    activation_func: Callable = quick_gelu
    activation_func_clamp_value: float | None = 7.0
    glu_linear_offset: float = 1.0
    # the router takes the top-k logits, then their softmax (GptOssTopKRouter)
    moe_router_pre_softmax: bool = False
    transformer_layer_spec: ModuleSpec | object = gpt_oss_layer_spec


# checkpoints written before the NeMo classes moved to models.gpt_oss_nemo name them here
__getattr__ = moved_to(__name__, "models.gpt_oss_nemo", "GptOssConfig", "GptOssModel")
