"""The gate's check of a checkpoint's multi-token-prediction (MTP) layers.

Megatron-Core's MTP layer ``k`` (``multi_token_prediction.py``) takes the previous layer's output
``h`` (the main model's after its final norm, for the first) and the embedding of the token one
further on, and computes ``final_layernorm(transformer_layer(eh_proj([enorm(e); hnorm(h)])))``,
whose logits come from the model's output layer. transformers' classes build no such layer (their
``save_pretrained`` writes none), so the HF side here is assembled from the family's own pieces:
the HF names the weight table gives each part, the HF class's decoder layer built at the MTP
layer's index (``num_hidden_layers + k``) and called with the arguments the model gave its last
decoder layer, norms of the kind of that layer's ``input_layernorm``, and ``eh_proj`` and the
head as plain matrix products. Both sides read the next token the way Megatron-Core does
(``roll_tensor``: left by one, a 0 at the end). Memory: one MTP layer per side, like one decoder
layer of the streamed gate.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from porting.errors import PortingError
from porting.parity.modules import (
    expert_lists,
    experts_streamed,
    release,
    set_param,
    stored_tensors,
    stream_expert_stacks,
)


@dataclass(frozen=True)
class MtpNames:
    """The HF tensors of MTP layer ``index`` (``num_hidden_layers + index`` in HF's numbering)."""

    index: int
    layer_prefix: str  # the HF decoder layer's tensors: layer_prefix + the layer's own names
    enorm: str
    hnorm: str
    eh_proj: str
    final_norm: str
    embedding: str
    head: str


def mtp_names(family, ctx, layers_prefix: str) -> list[MtpNames]:
    """Each MTP layer's HF names, read off the family's expanded weight table (``@`` entries)."""
    from porting.contract.mapping import expand

    concrete, _ = expand(family.weights, ctx, ctx.num_layers)
    hf_of = {c.mcore: c.hf for c in concrete}
    out = []
    for k in range(ctx.mtp_layers):
        own = f"{layers_prefix}.{ctx.num_layers + k}."

        def one(mcore: str, k=k) -> str:
            names = hf_of.get(f"mtp.layers.{k}.{mcore}")
            if not names or len(names) != 1:
                raise PortingError(
                    f"family {family.name}: its weight table maps no single HF tensor to "
                    f"mtp.layers.{k}.{mcore}; the gate cannot check the MTP layer"
                )
            return names[0]

        def copy_of(mcore: str, own=own) -> str | None:
            # the layer's own copy where the table reads one (DeepSeek-V3's), else the model's
            names = hf_of.get(mcore, ())
            return next((n for n in names if n.startswith(own)), names[0] if names else None)

        embedding = copy_of("embedding.word_embeddings.weight")
        head = copy_of("output_layer.weight") or embedding
        if embedding is None:
            raise PortingError(f"family {family.name}: no HF tensor makes the embedding")
        out.append(
            MtpNames(
                k,
                own,
                one("enorm.weight"),
                one("hnorm.weight"),
                one("eh_proj.weight"),
                one("final_layernorm.weight"),
                embedding,
                head,
            )
        )
    return out


def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's ``roll_tensor(ids, shifts=-1)``: each position's next token, 0 at the end."""
    out = torch.roll(ids, -1, dims=-1)
    out[..., -1] = 0
    return out


@torch.no_grad()
def hf_mtp_logits(
    names: list[MtpNames],
    read: Callable[[str, torch.Size | None], torch.Tensor],
    last_layer: torch.nn.Module,
    config,
    ids: torch.Tensor,
    normed: torch.Tensor,
    layer_kwargs: dict,
    table: Callable[[str], torch.Tensor],
    read_expert: Callable[[str, int, torch.Size], torch.Tensor] | None = None,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
    computing: Callable[[torch.nn.Module], AbstractContextManager] = lambda layer: nullcontext(),
) -> list[torch.Tensor]:
    """Each MTP layer's logits ``[b, s, vocab]`` on the HF side. ``last_layer``: the model's last
    decoder layer (its class and norm kind; its weights are not used); ``normed``: the model's
    final hidden state after its norm; ``layer_kwargs``: what the model passed its last layer
    besides the hidden states. ``read(key, shape)`` reads one HF tensor in fp32 (``None``: as
    stored); ``table(key)`` stands in for an embedding or head that is read by vocabulary slices
    (:class:`~porting.parity.vocab.VocabTable`); ``read_expert(key, e, shape)`` expert ``e`` of a transformers 5 expert stack, which
    the layer then reads one expert at a time (:func:`~porting.parity.modules.
    stream_expert_stacks`). ``linear(x, weight)``: how the projection and the head multiply (the
    gate's: the real positions only, counted); ``computing(layer)``: a context around the MTP
    layer's forward (the gate's counts its products and runs its linear layers on the real
    positions)."""
    from accelerate import init_empty_weights

    norm_kind = getattr(last_layer, "input_layernorm", None)
    if norm_kind is None:
        raise PortingError(
            f"{type(last_layer).__name__} has no input_layernorm: the gate cannot tell the MTP "
            "layer's norm kind"
        )
    out, hidden = [], normed
    for n in names:
        ids = next_tokens(ids)

        def norm(key: str) -> torch.nn.Module:
            module = copy.deepcopy(norm_kind)
            set_param(module, "weight", read(key, None))
            return module

        # the embedding and the head by vocabulary slices, the layer whole: one at a time
        embedded = F.embedding(ids, table(n.embedding))
        x = linear(
            torch.cat([norm(n.enorm)(embedded), norm(n.hnorm)(hidden)], dim=-1),
            read(n.eh_proj, None),
        )
        index = int(n.layer_prefix.rstrip(".").rsplit(".", 1)[1])
        with init_empty_weights():
            layer = type(last_layer)(config, layer_idx=index)
        layer.eval()
        if read_expert is not None:
            stream_expert_stacks(
                layer,
                lambda name, e, shape, n=n: read_expert(n.layer_prefix + name, e, shape),
            )
        skip = tuple(prefix for prefix, _ in expert_lists(layer))
        for name, p in list(stored_tensors(layer, skip)):
            set_param(layer, name, read(n.layer_prefix + name, p.shape))

        def expert(i, sub, e, module, real, n=n, device=x.device):
            return {
                name: read(f"{n.layer_prefix}{sub}{e}.{name}", p.shape)
                if real
                else torch.empty(p.shape, device=device)
                for name, p in stored_tensors(module)
            }

        with experts_streamed([(index, layer)], expert), computing(layer):
            y = layer(x, **layer_kwargs)
        release(layer)
        hidden = norm(n.final_norm)(y[0] if isinstance(y, tuple) else y)
        out.append(linear(hidden, table(n.head)))
    return out


@torch.no_grad()
def megatron_mtp_logits(
    model: torch.nn.Module,
    read: Callable[[str, tuple[str, ...]], dict[str, torch.Tensor]],
    ids: torch.Tensor,
    positions: torch.Tensor,
    decoder_out: torch.Tensor,
    decoder_kwargs: dict,
) -> list[torch.Tensor]:
    """Each MTP layer's logits ``[b, s, padded vocab]`` on the Megatron side: the model's own
    ``mtp`` block on the decoder's output, through the shared output layer, as
    ``GPTModel._postprocess`` computes them for its loss. ``read(name, skip)``: the stored
    tensors of the submodule ``name`` but those under the prefixes ``skip``; the experts stream
    one at a time (:func:`~porting.parity.modules.experts_streamed`)."""
    skip = tuple(prefix for prefix, _ in expert_lists(model.mtp))
    for name, value in read("mtp", skip).items():
        set_param(model.mtp, name, value)

    def expert(i, sub, e, module, real):
        if real:
            return read(f"mtp.{sub}{e}", ())
        return {
            name: torch.empty(p.shape, device=decoder_out.device)
            for name, p in stored_tensors(module)
        }

    kw = {
        k: decoder_kwargs.get(k)
        for k in ("attention_mask", "rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin")
    }
    # the embedding and the output layer are the main pass's vocabulary tables
    with experts_streamed([(0, model.mtp)], expert):
        stacked = model.mtp(
            input_ids=ids,
            position_ids=positions,
            hidden_states=decoder_out,
            embedding=model.embedding,
            **kw,
        )
    release(model.mtp)
    tied = model.share_embeddings_and_output_weights
    weight = model.shared_embedding_or_output_weight() if tied else None
    n = model.config.mtp_num_layers
    out = []
    for hidden in torch.chunk(stacked, 1 + n, dim=0)[1:]:
        logits, _ = model.output_layer(hidden, weight=weight)
        out.append(logits.transpose(0, 1))
    return out
