"""Granite (IBM Granite 3.x dense) on the stock GPT spec, with its multipliers added after the build.

transformers' ``GraniteModel`` is Llama's with four scalars (``models/granite``):

- the attention scores scaled by ``attention_multiplier``: Megatron's ``softmax_scale``, a config
  field the spec's core attention reads (local ``DotProductAttention``; Transformer Engine's);
- the embeddings multiplied by ``embedding_multiplier`` (a hook on ``embedding``);
- each sublayer's output multiplied by ``residual_multiplier`` before the residual add: hooks on
  ``self_attention`` and ``mlp``, whose ``(output, bias)`` is what Megatron's bias-dropout-add
  adds to the residual, so both are scaled (HF scales ``o_proj(x) + b`` as a whole too);
- the logits divided by ``logits_scaling`` (a hook on ``output_layer``).

Each is a Python float applied to the activation's own dtype, as transformers does. Hooks, not a
spec, so that whichever layer spec the config picks (Transformer Engine's where installed) keeps
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from models.llama import LlamaCore


def _scaled(factor: float):
    def hook(module, args, out):
        output, bias = out
        return output * factor, None if bias is None else bias * factor

    return hook


def add_multipliers(model, config) -> None:
    """Granite's multipliers as hooks on the modules this pipeline stage of ``model`` holds: the
    embedding, each layer's attention (``self_attention``) and MLP (``mlp``: a dense MLP or a
    mixture layer, each returning ``(output, bias)``) and the output layer."""
    embedding, emb = getattr(model, "embedding", None), config.embedding_multiplier
    if embedding is not None:
        embedding.register_forward_hook(lambda mod, args, out: out * emb)
    for layer in model.decoder.layers:
        layer.self_attention.register_forward_hook(_scaled(config.residual_multiplier))
        layer.mlp.register_forward_hook(_scaled(config.residual_multiplier))
    output, scale = getattr(model, "output_layer", None), config.logits_scaling
    if output is not None:
        output.register_forward_hook(lambda mod, args, out: (out[0] / scale, *out[1:]))


class Multiplied:
    """What a Granite config adds to its base config's: the multipliers, applied after the model is
    built (:func:`add_multipliers`), which is why Megatron-Bridge's provider cannot build it. The
    config holds ``embedding_multiplier``, ``residual_multiplier`` and ``logits_scaling``."""

    # what keeps Megatron-Bridge's GPTModelProvider from building this model (porting.convert.bridge)
    megatron_bridge_refusal: ClassVar[str] = (
        "the embedding, residual and logit multipliers are added by the family's configure_model, "
        "which Bridge's provider does not run"
    )

    def configure_model(self, tokenizer, pre_process=None, post_process=None, vp_stage=None):
        """Build the Megatron-Core GPT model, then add the multipliers (:func:`add_multipliers`)."""
        model = super().configure_model(tokenizer, pre_process, post_process, vp_stage)
        add_multipliers(model, self)
        return model


@dataclass
class GraniteCore(Multiplied, LlamaCore):
    """Megatron GPT config for Granite (defaults: granite-3.1-8b); the Llama fields and rotary
    scaling, ``softmax_scale`` from ``attention_multiplier``, and the three multipliers
    (:class:`Multiplied`)."""

    # the family's own Megatron-Bridge provider, where Bridge's cannot describe the model
    megatron_bridge_provider: ClassVar[str] = "models.granite_bridge.GraniteModelProvider"

    num_layers: int = 40
    hidden_size: int = 4096
    ffn_hidden_size: int = 12800
    num_attention_heads: int = 32
    num_query_groups: int = 8
    seq_length: int = 131072
    rotary_base: float = 10000000.0
    share_embeddings_and_output_weights: bool = True
    softmax_scale: float | None = 0.0078125
    embedding_multiplier: float = 12.0
    residual_multiplier: float = 0.22
    logits_scaling: float = 16.0
