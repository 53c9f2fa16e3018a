"""The Llama-family decoder on the stock Megatron GPT layer spec: the base of every family with
the Llama layout (tsuzumi, Mistral, Qwen; :mod:`converters.llama`).

Only config knobs differ from a Megatron GPT: pre-norm RMSNorm, GQA/MQA/MHA attention with rotary
embeddings (configurable base; linear, llama3 or YaRN scaling), a SwiGLU MLP, tied or untied output,
optional linear biases and QK-norm, and a padded vocabulary. The layer spec is the default GPT one
(:func:`porting.mcore.default_layer_spec`): Transformer Engine's where TE is installed, the local
spec elsewhere (the CPU). Its NeMo 2.0 classes: :mod:`models.llama_nemo`.

Example (the engine registers a family's HF connectors when it first loads its model class)::

    from nemo.collections import llm
    from converters.llama import FAMILY
    from porting.convert.connectors import model_class
    llm.import_ckpt(model=model_class(FAMILY)(), source="hf:///path/to/hf-dir")
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from porting import cpu
from porting.mcore import GPTCore, moved_to


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


def yarn_inv_freq(
    *,
    dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """YaRN's rotary frequencies ``[dim // 2]`` for a rotary of ``dim`` channels (fp32, on
    ``device`` whatever the default device: a model built under ``torch.device("meta")`` keeps
    its rotary frequencies real).

    The maths of ``transformers`` ``modeling_rope_utils._compute_yarn_parameters`` (4.57), in its
    order of fp32 operations: each frequency is a blend of the unscaled one (extrapolation) and
    the one divided by ``factor`` (interpolation). Channel pairs that turn more than ``beta_fast``
    times over ``original_max_position_embeddings`` positions keep theirs, those that turn fewer
    than ``beta_slow`` times are interpolated, and a linear ramp joins the two over the channel
    range between (its ends floored/ceiled when ``truncate``). The attention factor is not here:
    see :func:`yarn_softmax_scale`.
    """

    def correction_dim(rotations: float) -> float:
        # the channel index whose pair turns ``rotations`` times over the original length
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    channels = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = torch.clamp((channels - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def yarn_softmax_scale(attention_factor: float, kv_channels: int) -> float:
    """The softmax scale that applies YaRN's attention factor ``a``.

    transformers multiplies cos and sin by ``a`` (``LlamaRotaryEmbedding.forward``), on queries
    and keys alike, so every score ``q.k / sqrt(d)`` becomes ``a**2 q.k / sqrt(d)``; Megatron's
    ``softmax_scale`` multiplies the scores the same way (local ``DotProductAttention``: the
    ``alpha`` of its ``baddbmm``; Transformer Engine >= 1.10: passed to its attention). Megatron's
    own ``YarnRotaryEmbedding`` computes the factor but ``GPTModel`` drops it for standard
    attention (``rotary_pos_emb, _ = self.rotary_pos_emb(...)``), so it is not used.
    """
    return attention_factor**2 / math.sqrt(kv_channels)


@dataclass
class LlamaCore(GPTCore):
    """Megatron GPT config with the Llama-family defaults.

    ``rope_scaling_type`` is ``None``, ``"linear"`` (positions divided by
    ``seq_len_interpolation_factor``), ``"llama3"`` or ``"yarn"`` (the ``rope_scaling_*`` fields
    below). Both of the last two replace the rotary embedding's frequencies once the model is
    built; YaRN's attention factor becomes ``softmax_scale`` (:func:`yarn_softmax_scale`).
    """

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.llama_bridge.LlamaModelProvider"

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
    # YaRN only (transformers' defaults; the attention factor already resolved from the HF keys)
    rope_scaling_beta_fast: float = 32.0
    rope_scaling_beta_slow: float = 1.0
    rope_scaling_truncate: bool = True
    rope_scaling_attention_factor: float = 1.0

    def __post_init__(self) -> None:
        # TransformerConfig.__post_init__ rejects fusions whose kernels are missing: off first
        # (every CUDA-only one on the CPU; under CUDA those TE / apex would provide).
        cpu.kernel_safe_config(self)
        super().__post_init__()  # sets kv_channels when it was left out
        if self.rope_scaling_type == "yarn":
            scale = yarn_softmax_scale(self.rope_scaling_attention_factor, self.kv_channels)
            # a second __post_init__ (dataclasses.replace) finds its own value
            if self.softmax_scale is not None and not math.isclose(self.softmax_scale, scale):
                raise ValueError(
                    f"softmax_scale={self.softmax_scale!r} contradicts YaRN's attention factor "
                    f"{self.rope_scaling_attention_factor!r}, which needs {scale!r}"
                )
            self.softmax_scale = scale

    def configure_model(self, tokenizer, pre_process=None, post_process=None, vp_stage=None):
        """Build the Megatron-Core GPT model, then apply llama3 or YaRN rotary scaling if configured."""
        model = super().configure_model(tokenizer, pre_process, post_process, vp_stage)
        if self.rope_scaling_type == "yarn":
            rope = model.rotary_pos_emb
            inv_freq = yarn_inv_freq(
                dim=2 * rope.inv_freq.numel(),
                base=self.rotary_base,
                factor=self.rope_scaling_factor,
                original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings,
                beta_fast=self.rope_scaling_beta_fast,
                beta_slow=self.rope_scaling_beta_slow,
                truncate=self.rope_scaling_truncate,
                device=rope.inv_freq.device,
            )
            rope.inv_freq = inv_freq
            _check_softmax_scale(model, self.softmax_scale)
        elif self.rope_scaling_type == "llama3":
            rope = model.rotary_pos_emb
            rope.inv_freq = llama3_scaled_inv_freq(
                rope.inv_freq,
                factor=self.rope_scaling_factor,
                low_freq_factor=self.rope_scaling_low_freq_factor,
                high_freq_factor=self.rope_scaling_high_freq_factor,
                original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings,
            )
        return model


def _check_softmax_scale(model, scale: float) -> None:
    """Every layer's core attention must use ``scale``: Megatron hands ``softmax_scale`` to the
    local ``DotProductAttention`` and to Transformer Engine's only from TE 1.10 on, and a spec
    that dropped it would lose YaRN's attention factor without a word."""
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        got = getattr(core, "softmax_scale", None)
        if layer.config.apply_query_key_layer_scaling and got is not None:
            got *= core.layer_number  # divided by the layer number, multiplied back in softmax
        if got is None or not math.isclose(got, scale):
            raise ValueError(
                f"{type(core).__name__} of layer {layer.layer_number} scales attention scores by "
                f"{got!r}, not YaRN's softmax_scale {scale!r}"
            )


# checkpoints written before the NeMo classes moved to models.llama_nemo name them here
__getattr__ = moved_to(__name__, "models.llama_nemo", "LlamaConfig", "LlamaModel")
