"""The mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) on Megatron-Core's MoE layer.

Attention is the Llama/Qwen one (:class:`models.qwen.QwenCore`'s switches); every MLP is a
``MoELayer``: a router (a bias-free linear to one logit per expert), top-k routing, SwiGLU experts,
and for Qwen2-MoE a shared expert whose output is scaled by ``sigmoid(gate · x)``. Routing follows
HF exactly: Mixtral and ``norm_topk_prob`` Qwen take the softmax over the top-k logits
(``moe_router_pre_softmax=False``, the same numbers as HF's softmax-then-renormalise); Qwen2-MoE's
default takes the top-k of the full softmax without renormalising (``moe_router_pre_softmax``).
Expert outputs are weighted after the expert, as HF does. Experts are one module each
(``SequentialMLP``, ``moe_grouped_gemm=False``), so a checkpoint names
``mlp.experts.local_experts.<e>.linear_fc1.weight`` per expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.transformer.spec_utils import ModuleSpec

from models.qwen import QwenCore
from porting.mcore import default_layer_spec, moved_to, submodules_of


def moe_layer_spec(config: MoECore) -> ModuleSpec:
    """The default GPT layer spec for ``config`` (Transformer Engine where installed, else local), with the
    shared expert's gate switched on when the config has one (upstream's spec hard-codes it off)."""
    spec = default_layer_spec(config)
    mlp = spec.submodules.mlp
    # Megatron-Core 0.19 builds the MoE layer from a partial and passes the config's
    # moe_shared_expert_gate to the shared expert itself; 0.15's ModuleSpec takes it as a param
    if isinstance(mlp, ModuleSpec):
        shared = submodules_of(mlp).shared_experts
        if shared is not None:
            shared.params = {**shared.params, "gate": config.moe_shared_expert_gate}
    return spec


# Megatron-Bridge's default spec builds these layers too: Bridge runs on Megatron-Core 0.19, where
# the shared expert's gate comes from the config (moe_shared_expert_gate), as above
moe_layer_spec.megatron_bridge_spec = "megatron.bridge.models.gpt_provider.default_layer_spec"


@dataclass
class MoECore(QwenCore):
    """Megatron GPT config for the MoE family (defaults: Mixtral-8x7B's routing)."""

    num_moe_experts: int = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 14336
    moe_router_pre_softmax: bool = False
    moe_shared_expert_gate: bool = False
    moe_router_dtype: str = "fp32"
    moe_grouped_gemm: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.001
    # which HF names the MLP has ("mixtral": block_sparse_moe.experts.N.w1; "qwen":
    # mlp.experts.N.gate_proj), for the weight table's choice on export; not the Megatron model's,
    # so a Megatron-Bridge run_config.yaml leaves it out (porting.convert.bridge)
    hf_mlp_layout: str = field(default="mixtral", metadata={"megatron": False})
    transformer_layer_spec: ModuleSpec | object = moe_layer_spec


# checkpoints written before the NeMo classes moved to models.moe_nemo name them here
__getattr__ = moved_to(__name__, "models.moe_nemo", "MoEConfig", "MoEModel")
