"""Nemotron family <-> HF ``NemotronForCausalLM`` (Nemotron-4, Minitron, Nemotron-Mini): config
mapping, weight table.

The Llama layout's attention with three differences in the maths (transformers 4.57 and 5.x,
``models/nemotron``; :mod:`models.nemotron` says how each runs on Megatron-Core):

- the norms are ``LayerNorm1P``: a LayerNorm with a bias whose weight is stored zero-centred,
  ``F.layer_norm(x, w + 1, b)`` (Megatron's ``layernorm_zero_centered_gamma``, the tensors renamed
  as they are, biases included);
- the MLP is not gated: ``down_proj(relu(up_proj(x)) ** 2)`` (``hidden_act: relu2``), Megatron's
  ``linear_fc1`` / ``linear_fc2`` with ``squared_relu`` and ``gated_linear_unit=False``;
- partial rotary: the first ``int(head_dim x partial_rotary_factor)`` channels of each head are
  rotated (the class's default factor is 0.5), Megatron's ``rotary_percent``.

``head_dim`` may stand apart from ``hidden_size / num_attention_heads`` (Minitron-8B: 48 heads of
128 in a width of 4096). The checkpoints NVIDIA converted from NeMo also carry ``kv_channels``,
Megatron's name for it, which transformers never reads: carried where it equals the head width
transformers uses, refused otherwise. transformers 4.57's Nemotron never reads ``rope_scaling``
(its rotary type is fixed to the default) and 5.x applies it, so only an absent or null one is
carried.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from converters.llama import BIASES, QUERY_GROUPS
from converters.llama import WEIGHTS as LLAMA_WEIGHTS
from converters.llama import shape_context as llama_shape_context
from porting.contract.config_map import EVEN_WIDTH, Derived, Field, NoOp, Require
from porting.contract.family import Family, ShapeContext, Variant
from porting.contract.mapping import Rename
from porting.errors import PortingError

if TYPE_CHECKING:  # annotations only: the family's tables load without its Megatron side
    from models.nemotron import NemotronCore

# NemotronConfig's defaults, which a config.json that leaves the key out gets
DEFAULT_PARTIAL_ROTARY = 0.5
DEFAULT_INIT_STD = 0.0134


def head_width(hf: dict) -> int:
    """The head width transformers uses: ``head_dim``, or ``hidden_size // num_attention_heads``
    where it is absent or null (``NemotronConfig.__init__``)."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _head_dim_to_mcore(hf: dict) -> dict:
    width = head_width(hf)
    kv_channels = hf.get("kv_channels")
    if "kv_channels" in hf and kv_channels != width:
        raise PortingError(
            f"config.json: kv_channels={kv_channels!r} is not the head width transformers uses "
            f"({width}: head_dim, or hidden_size / num_attention_heads without it); transformers "
            "never reads kv_channels, so the two must agree"
        )
    return {"kv_channels": hf.get("head_dim")}


def _query_groups_to_mcore(hf: dict) -> dict:
    if hf.get("num_key_value_heads", 0) is None:
        # NemotronAttention divides the heads by it as given
        raise PortingError(
            "config.json: num_key_value_heads=None is not supported: transformers' "
            "NemotronAttention divides by it as given and fails on null"
        )
    return QUERY_GROUPS.to_mcore(hf)


def _rotary_to_mcore(hf: dict) -> dict:
    """``partial_rotary_factor`` (default 0.5) as Megatron's ``rotary_percent``, refused where the
    rotated width would be odd or zero (transformers' table is then narrower than its slice)."""
    factor = hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
    ok = isinstance(factor, int | float) and not isinstance(factor, bool)
    if not (ok and math.isfinite(factor) and 0 < factor <= 1):
        raise PortingError(
            f"config.json: partial_rotary_factor={factor!r} must be a number in (0, 1]"
        )
    dims = int(head_width(hf) * factor)
    if dims <= 0 or dims % 2:
        raise PortingError(
            f"config.json: partial_rotary_factor={factor!r} rotates {dims} channels of each head; "
            "it must be a positive even number"
        )
    return {"rotary_percent": float(factor)}


CONFIG = (
    Field("num_hidden_layers", "num_layers"),
    Field("hidden_size", "hidden_size"),
    Field("intermediate_size", "ffn_hidden_size"),
    Field("num_attention_heads", "num_attention_heads"),
    Derived(("num_key_value_heads",), _query_groups_to_mcore, QUERY_GROUPS.to_hf),
    # both carried verbatim on export (the derived value is never written in their place)
    Derived(
        ("head_dim", "kv_channels"), _head_dim_to_mcore, lambda c: {}, check=EVEN_WIDTH.or_null()
    ),
    Field("norm_eps", "layernorm_epsilon", default=1e-5),
    Field("rope_theta", "rotary_base", default=10000.0),
    Derived(("partial_rotary_factor",), _rotary_to_mcore, lambda c: {}),
    NoOp(
        "rope_scaling",
        (None,),
        "transformers 4.57's Nemotron never reads it (its rotary type is fixed to the default) "
        "and 5.x applies it, so the checkpoint has no one meaning",
    ),
    Field("tie_word_embeddings", "share_embeddings_and_output_weights", default=False),
    Field("max_position_embeddings", "seq_length", default=4096),
    Field("initializer_range", "init_method_std", default=DEFAULT_INIT_STD),
    Field("attention_dropout", "attention_dropout", default=0.0),
    BIASES,
    Require(
        "hidden_act",
        lambda v: v == "relu2",
        "the family's MLP is Nemotron's squared ReLU (relu2), which Megatron runs as squared_relu",
    ),
    Require("model_type", lambda v: v == "nemotron", "the HF side is the Nemotron layout"),
)

_L = "model.layers.*."
_M = "decoder.layers.*."
# Llama's table without its gated fc1 (gate_proj and up_proj stacked): Nemotron's MLP has up_proj
# alone, and each of its norms a bias
_GATED = (_M + "mlp.linear_fc1.weight", _M + "mlp.linear_fc1.bias")


def _biased(ctx: ShapeContext) -> bool:
    return ctx.attention_bias


WEIGHTS = (
    *(e for e in LLAMA_WEIGHTS if getattr(e, "mcore", None) not in _GATED),
    Rename(_L + "mlp.up_proj.weight", _M + "mlp.linear_fc1.weight"),
    Rename(_L + "mlp.up_proj.bias", _M + "mlp.linear_fc1.bias", when=_biased),
    Rename(_L + "input_layernorm.bias", _M + "input_layernorm.bias"),
    Rename(_L + "post_attention_layernorm.bias", _M + "pre_mlp_layernorm.bias"),
    Rename("model.norm.bias", "decoder.final_layernorm.bias"),
)


def shape_context(config: NemotronCore, vocab_size: int) -> ShapeContext:
    """Shape facts of a Nemotron config for the table (``vocab_size`` is the HF, unpadded one)."""
    return llama_shape_context(config, vocab_size)


FAMILY = Family(
    name="nemotron",
    architectures=("NemotronForCausalLM",),
    config_entries=CONFIG,
    weights=WEIGHTS,
    config_cls="models.nemotron_nemo:NemotronConfig",
    model_cls="models.nemotron_nemo:NemotronModel",
    core_config_cls="models.nemotron:NemotronCore",
    shape_context=shape_context,
    context_symbols=("models.nemotron:nemotron_block_spec", "models.nemotron:squared_relu"),
    summary="Nemotron-4 / Minitron: LayerNorm with a zero-centred weight and a bias, squared-ReLU "
    "MLP, partial rotary; the stock GPT layer with the family's norm",
    variants=(
        Variant(
            "minitron", "Minitron-8B layout: GQA, head_dim apart from hidden/heads, half rotary"
        ),
        Variant("mha_tied", "MHA, tied output, a quarter of each head rotated"),
        Variant("biases", "attention_bias and mlp_bias (every linear biased)"),
    ),
)
