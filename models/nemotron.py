"""Nemotron (Nemotron-4, Minitron) on Megatron-Core's GPT layer with the family's norm.

transformers' ``NemotronDecoderLayer`` is GPT's pre-norm layer; what differs is in config fields
and one module:

- ``NemotronLayerNorm1P`` is ``F.layer_norm(x, w + 1, b)`` in the input's dtype, its weight stored
  zero-centred. Megatron's ``layernorm_zero_centered_gamma`` is that maths, but the local spec's
  ``WrappedTorchNorm`` refuses it (and Apex's fused norm, where installed, computes otherwise), so
  the layer and the final norm are :class:`LayerNorm1P`, a module of the same parameter names
  (``weight``, ``bias``), on every device: the table reads the local spec's names, which
  Transformer Engine's fused norm+linear would not have.
- the MLP is ``linear_fc2(squared_relu(linear_fc1(x)))``: ``gated_linear_unit=False`` and
  :func:`squared_relu`, transformers' ``relu2`` (``ReLUSquaredActivation``).
- partial rotary is ``rotary_percent``: Megatron rotates the first ``int(kv_channels x percent)``
  channels of each head with that width's frequency table, as transformers' Nemotron does.

``layernorm_zero_centered_gamma`` is still set: Megatron-LM's checkpoint arguments
(``apply_layernorm_1p``, porting.convert.layouts.megatron_lm) and Transformer Engine's norms read
it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from models.llama import LlamaCore
from porting.mcore import block_of


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (transformers' ``relu2``); a function of ours so that NeMo's context
    names it here."""
    return torch.square(F.relu(x))


class LayerNorm1P(torch.nn.Module):
    """LayerNorm with a bias and a zero-centred weight, ``(1 + w)``, in the input's dtype (see the
    module docstring)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (hidden_size,)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in (self.weight, self.bias):
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` normed over its last dimension; same dtype as ``x``."""
        return F.layer_norm(x, self.shape, self.weight + 1, self.bias, self.eps)


def nemotron_block_spec(config: NemotronCore, vp_stage=None) -> ModuleSpec:
    """The decoder block spec: Megatron-Core's local GPT layer with :class:`LayerNorm1P` before
    attention and the MLP, and as the final norm."""
    layer = get_gpt_layer_local_spec(normalization="LayerNorm")
    layer.submodules.input_layernorm = LayerNorm1P
    layer.submodules.pre_mlp_layernorm = LayerNorm1P
    return block_of(layer, LayerNorm1P, config, vp_stage)


@dataclass
class NemotronCore(LlamaCore):
    """Megatron GPT config for Nemotron (defaults: Minitron-8B's layout); the Llama fields with a
    LayerNorm, a squared-ReLU MLP and half the head rotated, on :func:`nemotron_block_spec`."""

    normalization: str = "LayerNorm"
    layernorm_zero_centered_gamma: bool = True
    activation_func: Callable = squared_relu
    gated_linear_unit: bool = False
    rotary_percent: float = 0.5
    num_layers: int = 32
    hidden_size: int = 4096
    ffn_hidden_size: int = 16384
    num_attention_heads: int = 48
    num_query_groups: int = 8
    kv_channels: int | None = 128
    seq_length: int = 4096
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.0134
    # Megatron's fused bias+activation kernels are GELU/SwiGLU's only
    bias_activation_fusion: bool = False
    transformer_layer_spec: ModuleSpec | Callable = nemotron_block_spec
