"""The tsuzumi-style decoder: an in-house Llama-family model on the stock Megatron GPT layer spec.

Only config knobs differ from a Megatron GPT: pre-norm RMSNorm, GQA/MQA/MHA attention with rotary
embeddings (configurable base; linear or llama3-type scaling), a SwiGLU MLP, tied or untied output,
optional linear biases and QK-norm, and a padded vocabulary. The layer spec is NeMo's default: the
Transformer Engine spec where TE is installed, the local spec elsewhere (the CPU).

Example (the HF connectors are registered by the converter module, which the registry imports)::

    from nemo.collections import llm
    import converters.tsuzumi  # registers the HF importer/exporter
    from models.tsuzumi import TsuzumiConfig, TsuzumiModel
    llm.import_ckpt(model=TsuzumiModel(TsuzumiConfig()), source="hf:///path/to/hf-dir")
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from nemo.collections.llm.gpt.model.base import GPTConfig, GPTModel

from porting import cpu


def llama3_scaled_inv_freq(
    inv_freq: torch.Tensor,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3.1 frequency-dependent rotary scaling.

    Same function as ``transformers`` ``modeling_rope_utils._compute_llama3_parameters``: long
    wavelengths are divided by ``factor``, short ones kept, and the band between is interpolated.
    """
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass
class TsuzumiConfig(GPTConfig):
    """Megatron GPT config with the tsuzumi-style (Llama-family) defaults.

    ``rope_scaling_type`` is ``None``, ``"linear"`` (positions divided by
    ``seq_len_interpolation_factor``) or ``"llama3"`` (the ``rope_scaling_*`` fields below).
    """

    normalization: str = "RMSNorm"
    activation_func: Callable = F.silu
    gated_linear_unit: bool = True
    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    add_bias_linear: bool = False
    share_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    seq_length: int = 8192
    num_layers: int = 32
    hidden_size: int = 4096
    ffn_hidden_size: int = 11008
    num_attention_heads: int = 32
    num_query_groups: int = 8
    rotary_base: float = 10000.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    bias_activation_fusion: bool = True
    masked_softmax_fusion: bool = True
    persist_layer_norm: bool = True
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True

    rope_scaling_type: str | None = None
    rope_scaling_factor: float = 1.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        # TransformerConfig.__post_init__ rejects fusions whose kernels are missing: off first
        # (every CUDA-only one on the CPU; under CUDA those TE / apex would provide).
        cpu.kernel_safe_config(self)
        super().__post_init__()

    def configure_model(self, tokenizer, pre_process=None, post_process=None, vp_stage=None):
        """Build the Megatron-Core GPT model, then apply llama3 rotary scaling if configured."""
        model = super().configure_model(tokenizer, pre_process, post_process, vp_stage)
        if self.rope_scaling_type == "llama3":
            rope = model.rotary_pos_emb
            rope.inv_freq = llama3_scaled_inv_freq(
                rope.inv_freq,
                factor=self.rope_scaling_factor,
                low_freq_factor=self.rope_scaling_low_freq_factor,
                high_freq_factor=self.rope_scaling_high_freq_factor,
                original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings,
            )
        return model


class TsuzumiModel(GPTModel):
    """NeMo 2.0 model for the tsuzumi-style family (a ``GPTModel`` with :class:`TsuzumiConfig`)."""

    def __init__(
        self, config: TsuzumiConfig | None = None, optim=None, tokenizer=None, model_transform=None
    ):
        super().__init__(
            config or TsuzumiConfig(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )
