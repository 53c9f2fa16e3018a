"""Falcon's decoder blocks as Megatron-Core modules and layer specs (no NeMo needed).

Megatron-Core has no parallel block and no ALiBi, so this module adds :class:`FalconParallelLayer`
(a ``TransformerLayer`` whose ``forward`` alone differs; stock submodule names, so checkpoints keep
Megatron's key names) and :class:`AlibiDotProductAttention` (a ``DotProductAttention`` whose
``forward`` adds Falcon's ALiBi bias); the sequential RW block is the stock layer.
:func:`build_falcon_layer_spec` gives the spec of each block with local or Transformer Engine
modules, for any ``TransformerConfig``. The NeMo 2.0 config and model built on them are in
:mod:`models.falcon`, which describes the variants.
"""

from __future__ import annotations

import math

import torch
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from megatron.core.utils import make_viewless_tensor

from models.falcon_block import FalconBlock

try:
    from megatron.core.extensions.transformer_engine import HAVE_TE
except ImportError:
    HAVE_TE = False


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes in fp32, in Falcon's (and BLOOM's) arithmetic.

    Press et al. (2022): for ``n`` a power of two, slope ``i`` (1-based) is ``2 ** (-8 i / n)``; for
    other ``n``, the ``p`` slopes of the largest power of two ``p < n`` followed by every other slope
    of ``2 p`` heads. Computed as ``base ** i`` with an fp32 base and integer exponents, which is how
    ``transformers`` (``models/falcon/modeling_falcon.py``, ``build_alibi_tensor``) evaluates it, so
    that the bf16 rounding applied next lands on the same values.
    """
    p = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2.0 ** (-8.0 / p), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, p + 1, dtype=torch.int32))
    if p != num_heads:
        extra_base = torch.tensor(2.0 ** (-4.0 / p), dtype=torch.float32)
        extra = min(p, num_heads - p)
        odd = torch.arange(1, 1 + 2 * extra, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, odd)])
    return slopes


def alibi_bias(slopes: torch.Tensor, num_keys: int, device: torch.device) -> torch.Tensor:
    """Falcon's ALiBi bias ``[heads, 1, num_keys]`` in fp32, before the ``1/sqrt(head_dim)`` scale.

    Falcon biases each key by ``slope * key_position`` (not ``slope * (key - query)``: the two differ
    by a per-row constant that softmax removes), and both the slope and the product are rounded to
    bf16 as in its training code, which ``transformers`` keeps (``build_alibi_tensor``).
    """
    positions = torch.arange(num_keys, device=device)  # int64, as transformers' cumsum of a mask
    # bf16 slope times int64 positions stays bf16: the product is rounded to bf16 too
    bias = slopes.to(device).bfloat16()[:, None] * positions[None, :]
    return bias.float()[:, None, :]


class AlibiDotProductAttention(DotProductAttention):
    """Core attention with Falcon's ALiBi: ``softmax((q k^T + alibi) / sqrt(d) + causal mask) v``.

    Main difference from ``DotProductAttention``: the bias is added to the raw scores *before* the
    ``1/sqrt(head_dim)`` scale, as in ``transformers``' ``FalconAttention`` (its alibi branch), and
    the softmax runs in fp32. Under tensor parallelism each rank biases only its own heads, with
    those heads' slopes. Padding or document masks come in as ``attention_mask`` as usual.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported with ALiBi")
        heads = self.num_attention_heads_per_partition
        first = pg_collection.tp.rank() * heads
        # a plain attribute, not a buffer: model.to(dtype) must not round the slopes
        self.slopes = alibi_slopes(config.num_attention_heads)[first : first + heads]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``[sq, b, np, hn]`` query, ``[sk, b, ng, hn]`` key/value -> context ``[sq, b, np*hn]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ALiBi attention supports neither packed sequences nor an extra bias")
        heads = self.num_attention_heads_per_partition
        groups = self.num_query_groups_per_partition
        if heads > groups:
            # [sk, b, ng, hn] -> [sk, b, np, hn]: each KV head serves its group's query heads
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        sq, b, _, hn = query.shape
        sk = key.shape[0]
        # [sq, b, np, hn] -> [b*np, sq, hn]; [sk, b, np, hn] -> [b*np, hn, sk]
        q = query.reshape(sq, b * heads, hn).transpose(0, 1)
        k = key.reshape(sk, b * heads, hn).permute(1, 2, 0)
        scores = torch.bmm(q, k).float().view(b, heads, sq, sk)
        # [np, 1, sk] broadcast over batch and queries; then the 1/sqrt(d) scale, in that order
        logits = (scores + alibi_bias(self.slopes, sk, scores.device)) * self.softmax_scale
        if attention_mask is None:
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            if mask_type == AttnMaskType.causal:
                attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=logits.device).triu(
                    sk - sq + 1
                )
        if attention_mask is not None:
            logits = logits.masked_fill(attention_mask, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, dim=-1).to(value.dtype)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        else:
            probs = self.attention_dropout(probs)
        # [b*np, sq, sk] x [b*np, sk, hn] -> [b*np, sq, hn] -> [sq, b, np*hn]
        v = value.reshape(sk, b * heads, hn).transpose(0, 1)
        context = torch.bmm(probs.view(b * heads, sq, sk), v)
        return context.view(b, heads, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


class FalconParallelLayer(TransformerLayer):
    """Falcon's parallel block: ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))``.

    With ``shared_norm`` (Falcon 7B, 11B) ``ln_mlp`` is ``ln_attn`` (``input_layernorm``) and
    ``pre_mlp_layernorm`` is an ``IdentityOp``; otherwise (40B, 180B) ``pre_mlp_layernorm`` is the
    second norm, applied to the layer input rather than to ``x + attn``.

    Main difference from Megatron's ``TransformerLayer``, which computes
    ``h = x + attn(ln1(x)); h + mlp(ln2(h))``: the MLP reads the layer input, not ``h``. The
    attention half (norm, attention, bias-dropout-add, recompute) is the stock ``_forward_attention``;
    only the MLP half is replaced.
    """

    def __init__(self, *args, shared_norm: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shared_norm = shared_norm
        if self.recompute_pre_mlp_layernorm:
            raise ValueError(
                "recompute_modules 'layernorm' is not supported by Falcon's parallel layer "
                "(its MLP norm reads the layer input); remove it from recompute_modules"
            )

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """Same interface and outputs as ``TransformerLayer.forward``."""
        kwargs.pop("dynamic_inference_decode_only", None)
        # x + attn(ln_attn(x)), with all of the stock layer's machinery
        attn_residual, context = self._forward_attention(hidden_states, *args, **kwargs)
        return self._forward_parallel_mlp(hidden_states, attn_residual), context

    def _forward_parallel_mlp(self, layer_input: torch.Tensor, residual: torch.Tensor):
        """``residual + mlp(ln_mlp(layer_input))`` with the stock bias-dropout-add."""
        norm = self.input_layernorm if self.shared_norm else self.pre_mlp_layernorm
        mlp_input = norm(layer_input)
        if self.recompute_mlp:
            mlp_output_with_bias = tensor_parallel.checkpoint(self.mlp, False, mlp_input)
        else:
            mlp_output_with_bias = self.mlp(mlp_input)
        with self.bias_dropout_add_exec_handler():
            out = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                mlp_output_with_bias, residual, self.hidden_dropout
            )
        return make_viewless_tensor(inp=out, requires_grad=out.requires_grad, keep_graph=True)


def _backend(use_te: bool) -> BackendSpecProvider:
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def build_falcon_layer_spec(block: FalconBlock, *, alibi: bool, use_te: bool) -> ModuleSpec:
    """The layer spec for one Falcon block, with local or Transformer Engine modules.

    With TE, norms are fused into the following linear layer where each norm feeds one layer
    (sequential, two norms), as in Megatron's own TE spec; the shared norm feeds two layers and
    stays a separate ``TENorm``. ALiBi always uses :class:`AlibiDotProductAttention`: TE's fused
    ALiBi has its own bias arithmetic, not Falcon's bf16 per-key bias.
    ``sharded_state_dict_keys_map`` stores unfused norms under the fused names, so checkpoints of
    the two specs are interchangeable (as for Megatron's GPT specs).
    """
    backend = _backend(use_te)
    fuse = backend.fuse_layernorm_and_linear() and block != FalconBlock.PARALLEL_SHARED_NORM
    norm = IdentityOp if fuse else backend.layer_norm()
    qkv = backend.column_parallel_layer_norm_linear() if fuse else backend.column_parallel_linear()
    fc1 = backend.column_parallel_layer_norm_linear() if fuse else backend.column_parallel_linear()
    if block == FalconBlock.PARALLEL_SHARED_NORM:
        input_norm, pre_mlp_norm = backend.layer_norm(), IdentityOp
        keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    else:
        input_norm = pre_mlp_norm = norm
        keys_map = {
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
        }
    if block == FalconBlock.SEQUENTIAL:
        module, params = TransformerLayer, {}
    else:
        module = FalconParallelLayer
        params = {"shared_norm": block == FalconBlock.PARALLEL_SHARED_NORM}
    submodules = TransformerLayerSubmodules(
        input_layernorm=input_norm,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=qkv,
                core_attention=AlibiDotProductAttention if alibi else backend.core_attention(),
                linear_proj=backend.row_parallel_linear(),
                q_layernorm=IdentityOp,
                k_layernorm=IdentityOp,
            ),
        ),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=pre_mlp_norm,
        mlp=ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=backend.row_parallel_linear()),
        ),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=keys_map if not fuse else {},
    )
    return ModuleSpec(module=module, params=params, submodules=submodules)
