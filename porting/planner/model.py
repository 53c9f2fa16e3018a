"""Model shapes for planning: read from an HF ``config.json``, an imported checkpoint or a preset.

Only the shape matters here (no weights). Sizes, parameter counts and FLOPs per token follow
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21, eq. 2 and 3), generalised to grouped-query attention, gated MLPs (SwiGLU),
untied output layers, Falcon's parallel attention+MLP block, DeepSeek's multi-head latent
attention and mixture-of-experts layers (routed experts, shared experts, dense first layers): the
FLOPs count the experts a token is routed to (top-k), the parameters every expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from porting.contract import hf_spelling, registry
from porting.errors import PortingError
from porting.planner.limits import MAX_CONFIG_BYTES, parse_json, positive_int, read_text, show

# Ceilings on a model's shape (docs/planner.md "Limits"), far above any published dense decoder
# (hidden 25,600 for GPT 1T, ~130 layers, 160 heads, vocabularies of ~260k): past them a config
# is a typo or a hostile file, and its FLOP and memory sums stop meaning anything.
SHAPE_LIMITS = {
    "hidden": positive_int(1 << 17),
    "layers": positive_int(4096),
    "heads": positive_int(1 << 14),
    "kv_heads": positive_int(1 << 14),
    "ffn": positive_int(1 << 20),
    "vocab": positive_int(1 << 24),
    "head_dim": positive_int(1 << 14),
    # DeepSeek-V3 has 256 routed experts, top-8; the largest published counts are in the
    # thousands (fine-grained experts), so 1 << 16 leaves room without letting a sum overflow
    "experts": positive_int(1 << 16),
    "top_k": positive_int(1 << 16),
    "moe_ffn": positive_int(1 << 20),
    "shared_ffn": positive_int(1 << 22),
    "moe_layers": positive_int(4096),
    "groups": positive_int(1 << 16),
    "group_limit": positive_int(1 << 16),
    "q_lora": positive_int(1 << 17),
    "kv_lora": positive_int(1 << 17),
    "rope_dim": positive_int(1 << 14),
    "v_head_dim": positive_int(1 << 14),
}
# Fields that are 0 for "not there" (a dense model, no MLA, no shared experts).
_OPTIONAL = {
    "head_dim", "experts", "top_k", "moe_ffn", "shared_ffn", "moe_layers", "groups",
    "group_limit", "q_lora", "kv_lora", "rope_dim", "v_head_dim",
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer, as far as time and memory depend on it.

    ``gated`` is a SwiGLU-style MLP (``fc1`` produces gate and up, ``2 * ffn`` wide);
    ``parallel_attn`` is Falcon's block where attention and MLP read the same normed input
    (one shared norm when ``norms_per_layer`` is 1). ``learned_positions`` is the size of a
    learned absolute position table (GPT-2/3 style), 0 for rotary or ALiBi.

    A mixture-of-experts model has ``experts`` routed experts of width ``moe_ffn``, each token
    sent to ``top_k`` of them, plus shared experts ``shared_ffn`` wide in all (every token goes
    through them) and a router; ``moe_layers`` of the layers (the last ones: DeepSeek's first
    ``first_k_dense_replace`` layers are dense, ``ffn`` wide) are MoE layers. ``groups`` and
    ``group_limit`` are DeepSeek-V3's node-limited routing (``n_group``, ``topk_group``: a
    token's experts come from at most ``group_limit`` of ``groups`` equal groups of experts).
    ``kv_lora`` > 0 is DeepSeek's multi-head latent attention: queries through a
    ``q_lora``-rank bottleneck (0: none), keys and values from a ``kv_lora``-rank latent plus a
    ``rope_dim``-wide shared rotary key, ``head_dim`` the query/key width per head and
    ``v_head_dim`` the value width (0: ``head_dim``).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    gated: bool = True
    head_dim: int = 0
    parallel_attn: bool = False
    norms_per_layer: int = 2
    layernorm: bool = False  # LayerNorm (weight and bias) instead of RMSNorm (weight only)
    bias: bool = False  # biases on the linear layers
    learned_positions: int = 0
    dropout: bool = False  # hidden/attention dropout on: its masks are stored for backward
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    moe_layers: int = 0
    groups: int = 0
    group_limit: int = 0
    q_lora: int = 0
    kv_lora: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for field_name, accepted in SHAPE_LIMITS.items():
            if field_name not in _OPTIONAL or getattr(self, field_name):
                accepted.check(getattr(self, field_name), f"model {self.name}: {field_name}")
        if self.experts:
            self._check_moe()
        if self.heads % self.kv_heads:
            raise PortingError(
                f"model {self.name}: num_key_value_heads {self.kv_heads} does not divide "
                f"num_attention_heads {self.heads}"
            )
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise PortingError(
                    f"model {self.name}: hidden_size {self.hidden} is not a multiple of "
                    f"num_attention_heads {self.heads} (give head_dim)"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if not self.v_head_dim:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.kv_lora and self.rope_dim >= self.head_dim:
            raise PortingError(
                f"model {self.name}: qk_rope_head_dim {self.rope_dim} leaves no room in the "
                f"query/key head of {self.head_dim}"
            )
        # asked for several times by every layout the search predicts
        object.__setattr__(self, "_matmul_params", self._count_matmul_params())

    def _check_moe(self) -> None:
        where = f"model {self.name}"
        if not self.top_k or not self.moe_ffn:
            raise PortingError(
                f"{where}: {self.experts} experts but no top-k (num_experts_per_tok) or expert "
                "width (moe_intermediate_size)"
            )
        if self.top_k > self.experts:
            raise PortingError(
                f"{where}: each token routed to {self.top_k} of {self.experts} experts"
            )
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", self.layers)
        if self.moe_layers > self.layers:
            raise PortingError(f"{where}: {self.moe_layers} MoE layers of {self.layers}")
        if self.groups or self.group_limit:
            if not (self.groups and self.group_limit) or self.experts % self.groups:
                raise PortingError(
                    f"{where}: n_group {self.groups} must divide the {self.experts} experts, "
                    "with topk_group set"
                )
            if self.group_limit > self.groups:
                raise PortingError(
                    f"{where}: topk_group {self.group_limit} is more than n_group {self.groups}"
                )
            if self.top_k > self.group_limit * (self.experts // self.groups):
                raise PortingError(
                    f"{where}: top-{self.top_k} cannot come from {self.group_limit} groups of "
                    f"{self.experts // self.groups} experts"
                )

    def tp_collectives_per_layer(self) -> float:
        """Sequence-parallel all-gathers and reduce-scatters per layer and pass (the mean over
        the layers): two around attention, two around a dense MLP or the shared experts; the
        routed experts take the sharded tokens through the all-to-all instead."""
        if not self.moe:
            return 4
        dense = self.layers - self.moe_layers
        moe = 2 + (2 if self.shared_ffn else 0)
        return (4 * dense + moe * self.moe_layers) / self.layers

    @property
    def moe(self) -> bool:
        """Whether the model has mixture-of-experts layers."""
        return self.experts > 0

    def matmul_params_per_layer(self) -> int:
        """Weights of the linear layers of one block (what the GEMM FLOPs scale with)."""
        return self._matmul_params

    @property
    def q_width(self) -> int:
        """Width of the query projection (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of one of the key/value projections (KV heads x head_dim)."""
        return self.kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        """Width of the attention output before the projection (heads x value head dim)."""
        return self.heads * self.v_head_dim

    def attention_params(self) -> int:
        """Linear weights of one attention block (MLA: down, up and output projections)."""
        h = self.hidden
        if not self.kv_lora:
            return h * (self.q_width + 2 * self.kv_width) + self.q_width * h
        q = h * self.q_lora + self.q_lora * self.q_width if self.q_lora else h * self.q_width
        nope = self.head_dim - self.rope_dim
        kv = h * (self.kv_lora + self.rope_dim) + self.kv_lora * self.heads * (
            nope + self.v_head_dim
        )
        return q + kv + self.v_width * h

    def _mlp(self, width: int) -> int:
        return self.hidden * width * (2 if self.gated else 1) + width * self.hidden

    def expert_params(self) -> int:
        """Weights of one routed expert."""
        return self._mlp(self.moe_ffn) if self.moe else 0

    def moe_shared_params(self) -> int:
        """Weights of an MoE layer every token goes through: the shared experts and the router."""
        return self._mlp(self.shared_ffn) + self.hidden * self.experts if self.moe else 0

    def _count_matmul_params(self) -> int:
        attn = self.attention_params()
        if not self.moe:
            return attn + self._mlp(self.ffn)
        dense = self.layers - self.moe_layers
        active = self.moe_shared_params() + self.top_k * self.expert_params()
        # the mean over the layers: FLOPs sum over a stage's layers
        return attn + (dense * self._mlp(self.ffn) + self.moe_layers * active) / self.layers

    def dense_layer_params(self) -> int:
        """All parameters of a dense layer of an MoE model (DeepSeek's first layers)."""
        return self.attention_params() + self._norms_and_biases() + self._mlp(self.ffn)

    def layer_params(self) -> tuple[int, int]:
        """(parameters Megatron shards with TP, those it shards with expert parallelism) of the
        heaviest layer: an MoE layer's routed experts are the second part, all else the first."""
        n = self.attention_params() + self._norms_and_biases()
        if self.moe and self.moe_layers:
            return n + self.moe_shared_params(), self.experts * self.expert_params()
        return n + self._mlp(self.ffn), 0

    def _norms_and_biases(self) -> int:
        n = self.norms_per_layer * self.hidden * (2 if self.layernorm else 1)
        if self.kv_lora:
            n += self.q_lora + self.kv_lora  # MLA's norms on its two latents
        if self.bias:
            n += self.q_width + 2 * self.kv_width + self.hidden
            n += self.ffn * (2 if self.gated else 1) + self.hidden
        return n

    def params_per_layer(self) -> int:
        """All parameters of one block (the mean over the layers): linear weights, every
        expert's, their biases and the norms."""
        if not self.moe:
            return self.attention_params() + self._norms_and_biases() + self._mlp(self.ffn)
        dense = self.layers - self.moe_layers
        mlp = dense * self._mlp(self.ffn) + self.moe_layers * (
            self.moe_shared_params() + self.experts * self.expert_params()
        )
        return self.attention_params() + self._norms_and_biases() + mlp / self.layers

    def padded_vocab(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron pads the vocabulary to a multiple of ``divisible_by * tp`` (its arguments.py)."""
        step = divisible_by * tp
        return -(-self.vocab // step) * step

    def embedding_params(self, tp: int = 1) -> int:
        """Input embedding (padded vocabulary) plus a learned position table if any."""
        return self.padded_vocab(tp) * self.hidden + self.learned_positions * self.hidden

    def total_params(self, tp: int = 1) -> int:
        """Every parameter with the vocabulary padded for ``tp``, output layer counted if untied."""
        final_norm = self.hidden * (2 if self.layernorm else 1)
        n = round(self.layers * self.params_per_layer()) + self.embedding_params(tp) + final_norm
        if not self.tied:
            n += self.padded_vocab(tp) * self.hidden
        return n

    def model_flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token without recomputation: 6N + attention + logits.

        Narayanan et al. eq. 3 divided by the tokens of a batch and by 4/3 (their count includes
        the recomputed forward): ``72 l h^2 (1 + s/(6h)) + 6 h V`` for GPT, i.e. 6 x matmul
        weights of the blocks (an MoE layer's: the experts a token is routed to), ``12 l s
        (heads x head_dim)`` for QK^T and PV over the full (non-causal) square (``6 l s`` x the
        query/key plus the value widths where they differ, as MLA's), and ``6 h V`` for the
        logits. MFU uses this count.
        """
        per_layer = 6 * self.matmul_params_per_layer() + 6 * seq_length * self.score_width
        return self.layers * per_layer + 6 * self.hidden * self.vocab

    @property
    def score_width(self) -> int:
        """Query/key plus value widths: what the score and value GEMMs of attention scale with."""
        return self.q_width + self.v_width


def count(value: object, field_name: str, source: str, shape_field: str) -> int:
    """``value`` of the HF field ``field_name`` if it is within the ceiling of ``shape_field``."""
    return int(SHAPE_LIMITS[shape_field].check(value, f"{source}: {field_name}"))


def need(cfg: dict, source: str, shape_field: str, *names: str) -> int:
    """The first of ``names`` present in ``cfg`` (HF configs rename fields across versions)."""
    for name in names:
        if name in cfg and cfg[name] is not None:
            return count(cfg[name], name, source, shape_field)
    raise PortingError(f"{source}: missing field {names[0]}")


EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _layer_set(cfg: dict, key: str, layers: int, source: str) -> set[int]:
    """A list of layer indices (Qwen's ``mlp_only_layers``), each checked."""
    value = cfg.get(key) or []
    if not isinstance(value, list):
        raise PortingError(f"{source}: {key}: expected a list of layer indices, got {show(value)}")
    out = set()
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < layers:
            raise PortingError(f"{source}: {key}: {show(item)} is not a layer index below {layers}")
        out.add(item)
    return out


def _step(cfg: dict, key: str, source: str) -> int:
    value = cfg.get(key)
    return 1 if value is None else count(value, key, source, "layers")


# Fields that place experts (or other kinds of layers) by rules the reader does not know (Jamba's
# expert_layer_period, Llama 4's interleave_moe_layer_step, ERNIE's moe_layer_start_index):
# refused rather than planned with every layer an MoE layer.
_UNKNOWN_PLACEMENT = (
    "expert_layer_period",
    "expert_layer_offset",
    "interleave_moe_layer_step",
    "moe_layer_start_index",
    "moe_layer_end_index",
    "moe_layer_interval",
    "attn_layer_period",
    "attn_layer_offset",
)
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def moe_fields(cfg: dict, source: str, layers: int) -> dict:
    """The mixture-of-experts fields of an HF config (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3,
    OLMoE, gpt-oss, Phi-3.5-MoE), empty for a dense model."""
    key = next((k for k in EXPERT_FIELDS if cfg.get(k)), None)
    if key is None:
        return {}
    unknown = next((k for k in _UNKNOWN_PLACEMENT if cfg.get(k) is not None), None)
    if unknown:
        raise PortingError(
            f"{source}: {unknown}: the planner does not know which layers this places experts "
            "or other blocks in (it reads decoder_sparse_step, mlp_only_layers, "
            "first_k_dense_replace and moe_layer_freq)"
        )
    kinds = cfg.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list):
            raise PortingError(f"{source}: layer_types: expected a list, got {show(kinds)}")
        other = next((k for k in kinds if k not in _ATTENTION_LAYER_TYPES), None)
        if other is not None:
            raise PortingError(
                f"{source}: layer_types: {show(other)} layers are not in the planner's model "
                "(it plans attention layers: full or sliding)"
            )
    experts = count(cfg[key], key, source, "experts")
    k_key = next((k for k in ("num_experts_per_tok", "experts_per_token") if cfg.get(k)), None)
    if k_key is None:
        raise PortingError(f"{source}: {key} {experts} but no num_experts_per_tok")
    top_k = count(cfg[k_key], k_key, source, "top_k")
    # an expert's width: moe_intermediate_size where a model also has dense layers
    # (intermediate_size is then theirs), else intermediate_size (Mixtral, OLMoE, gpt-oss)
    w_key = "moe_intermediate_size" if cfg.get("moe_intermediate_size") else "intermediate_size"
    moe_ffn = need(cfg, source, "moe_ffn", w_key)
    shared = 0
    if cfg.get("shared_expert_intermediate_size"):
        shared = count(
            cfg["shared_expert_intermediate_size"],
            "shared_expert_intermediate_size",
            source,
            "shared_ffn",
        )
    elif cfg.get("n_shared_experts"):
        shared = count(cfg["n_shared_experts"], "n_shared_experts", source, "experts") * moe_ffn
    # which layers are MoE: DeepSeek's first_k_dense_replace / moe_layer_freq, Qwen's
    # decoder_sparse_step / mlp_only_layers
    first_dense = cfg.get("first_k_dense_replace") or 0
    if first_dense:
        first_dense = count(first_dense, "first_k_dense_replace", source, "layers")
    freq = _step(cfg, "moe_layer_freq", source)
    sparse = _step(cfg, "decoder_sparse_step", source)
    dense_only = _layer_set(cfg, "mlp_only_layers", layers, source)
    moe_layers = sum(
        1
        for i in range(layers)
        if i >= first_dense and i % freq == 0 and (i + 1) % sparse == 0 and i not in dense_only
    )
    if not moe_layers:
        raise PortingError(
            f"{source}: {experts} experts but no layer is a mixture-of-experts layer"
        )
    fields = dict(
        experts=experts, top_k=top_k, moe_ffn=moe_ffn, shared_ffn=shared, moe_layers=moe_layers
    )
    if cfg.get("n_group") or cfg.get("topk_group"):
        fields["groups"] = need(cfg, source, "groups", "n_group")
        fields["group_limit"] = need(cfg, source, "group_limit", "topk_group")
    return fields


def mla_fields(cfg: dict, source: str) -> dict:
    """Multi-head latent attention's fields (DeepSeek's ``kv_lora_rank`` and the rest), empty
    where the config has none: for a family's :attr:`~porting.contract.family.Family.plan_shape`."""
    if not cfg.get("kv_lora_rank"):
        return {}
    heads = need(cfg, source, "heads", "num_attention_heads")
    nope = need(cfg, source, "head_dim", "qk_nope_head_dim")
    rope = need(cfg, source, "rope_dim", "qk_rope_head_dim")
    return dict(
        kv_lora=count(cfg["kv_lora_rank"], "kv_lora_rank", source, "kv_lora"),
        q_lora=count(cfg["q_lora_rank"], "q_lora_rank", source, "q_lora")
        if cfg.get("q_lora_rank")
        else 0,
        head_dim=count(nope + rope, "qk_nope_head_dim + qk_rope_head_dim", source, "head_dim"),
        rope_dim=rope,
        v_head_dim=need(cfg, source, "v_head_dim", "v_head_dim"),
        kv_heads=heads,  # keys and values decompress to every head
    )


def from_hf_config(cfg: dict, source: str = "config.json", name: str | None = None) -> ModelShape:
    """Build a shape from an HF ``config.json`` dict, read by the family that claims it
    (its :attr:`~porting.contract.family.Family.plan_shape`), else as the Llama layout
    (:func:`llama_layout`): the planner holds no family's rules. A vision-language container
    (``Family.containers``) is planned as its language model."""
    if not isinstance(cfg, dict):
        raise PortingError(f"{source}: expected a JSON object")
    held = registry.container_for(cfg)
    if held is not None:  # a vision-language class: its language model is what trains here
        cfg = held[1].text_view(cfg, source)
    family = registry.claiming(cfg)
    if family is not None and family.plan_shape is not None:
        fields = family.plan_shape(cfg, source, READERS)
    else:
        fields = llama_layout(cfg, source)
    if not isinstance(fields, dict):
        raise PortingError(
            f"family {family.name}'s plan_shape ({family.source}) returned "
            f"{type(fields).__name__}, not the dict of ModelShape fields"
        )
    try:
        return ModelShape(name=name or source, **fields)
    except TypeError as err:  # a plugin's reader naming a field ModelShape lacks
        raise PortingError(f"family {family.name}'s plan_shape ({family.source}): {err}") from None


def llama_layout(cfg: dict, source: str) -> dict:
    """The :class:`ModelShape` fields of a Llama-layout config (``hidden_size``,
    ``num_key_value_heads``, ``intermediate_size``, ``hidden_act``; experts by
    :func:`moe_fields`): the reading of every family that gives no ``plan_shape`` of its own."""
    hidden = need(cfg, source, "hidden", "hidden_size")
    layers = need(cfg, source, "layers", "num_hidden_layers")
    heads = need(cfg, source, "heads", "num_attention_heads")
    head_dim = cfg.get("head_dim") or 0
    if head_dim:
        head_dim = count(head_dim, "head_dim", source, "head_dim")
    kv = cfg.get("num_key_value_heads")
    kv = heads if kv is None else count(kv, "num_key_value_heads", source, "kv_heads")
    act = str(cfg.get("hidden_act", "silu"))
    return dict(
        hidden=hidden,
        layers=layers,
        heads=heads,
        ffn=need(cfg, source, "ffn", "intermediate_size"),
        vocab=need(cfg, source, "vocab", "vocab_size"),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        # gpt-oss's "silu" is its clamped SwiGLU: gated all the same
        gated=act in ("silu", "swiglu", "swish"),
        bias=bool(cfg.get("attention_bias", False) or cfg.get("mlp_bias", False)),
        dropout=bool(cfg.get("attention_dropout", 0.0) or cfg.get("hidden_dropout", 0.0)),
        head_dim=head_dim,
        kv_heads=kv,
        **moe_fields(cfg, source, layers),
    )


@dataclass(frozen=True)
class Readers:
    """The planner's config readers, handed to a family's ``plan_shape`` (a family module never
    imports the planner, which finds families through the registry): each checks a value
    against the planner's ceilings (:data:`SHAPE_LIMITS`) and names the field."""

    count: Callable[..., int] = count
    need: Callable[..., int] = need
    show: Callable[[object], str] = show
    llama_layout: Callable[[dict, str], dict] = llama_layout
    moe_fields: Callable[[dict, str, int], dict] = moe_fields
    mla_fields: Callable[[dict, str], dict] = mla_fields
    expert_fields: tuple[str, ...] = EXPERT_FIELDS


READERS = Readers()


def _gpt(name: str, hidden: int, layers: int, heads: int) -> ModelShape:
    # Narayanan et al. Table 1: GPT with 4h GELU MLP, LayerNorm, biases, learned positions
    # (sequence 2048), tied embeddings, vocabulary 51,200, dropout on.
    return ModelShape(
        name=name,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=heads,
        ffn=4 * hidden,
        vocab=51200,
        tied=True,
        gated=False,
        layernorm=True,
        bias=True,
        learned_positions=2048,
        dropout=True,
    )


PRESETS: dict[str, ModelShape] = {
    # meta-llama/Llama-2-7b-hf, -13b-hf, -70b-hf config.json
    "llama-7b": ModelShape("llama-7b", 4096, 32, 32, 32, 11008, 32000),
    "llama-13b": ModelShape("llama-13b", 5120, 40, 40, 40, 13824, 32000),
    "llama-70b": ModelShape("llama-70b", 8192, 80, 64, 8, 28672, 32000),
    # meta-llama/Meta-Llama-3-8B and -70B config.json
    "llama3-8b": ModelShape("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": ModelShape("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
    # meta-llama/Llama-3.1-405B config.json (rope scaling does not change the cost)
    "llama3.1-405b": ModelShape("llama3.1-405b", 16384, 126, 128, 8, 53248, 128256),
    # tiiuae/falcon-7b (MQA, parallel block, one norm) and falcon-40b (8 KV groups, two norms)
    "falcon-7b": ModelShape(
        "falcon-7b",
        4544,
        32,
        71,
        1,
        18176,
        65024,
        tied=True,
        gated=False,
        parallel_attn=True,
        norms_per_layer=1,
        layernorm=True,
    ),  # fmt: skip
    "falcon-40b": ModelShape(
        "falcon-40b",
        8192,
        60,
        128,
        8,
        32768,
        65024,
        tied=True,
        gated=False,
        parallel_attn=True,
        norms_per_layer=2,
        layernorm=True,
    ),  # fmt: skip
    # Narayanan et al. (SC'21) Table 1
    "gpt-1.7b": _gpt("gpt-1.7b", 2304, 24, 24),
    "gpt-3.6b": _gpt("gpt-3.6b", 3072, 30, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 4096, 36, 32),
    "gpt-18b": _gpt("gpt-18b", 6144, 40, 48),
    "gpt-39b": _gpt("gpt-39b", 8192, 48, 64),
    "gpt-76b": _gpt("gpt-76b", 10240, 60, 80),
    "gpt-145b": _gpt("gpt-145b", 12288, 80, 96),
    "gpt-310b": _gpt("gpt-310b", 16384, 96, 128),
    "gpt-530b": _gpt("gpt-530b", 20480, 105, 128),
    "gpt-1t": _gpt("gpt-1t", 25600, 128, 160),
    # The small debug size (STYLE.md): a GQA shape that plans in milliseconds.
    "tiny": ModelShape("tiny", 256, 4, 8, 4, 688, 1024),
}


# Mixture-of-experts presets, from their published config.json fields (MTP layers and MoE
# routing details that do not change cost left out).
_MOE_CONFIGS = {
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    # mistralai/Mixtral-8x22B-v0.1 (the mistral-community conversion has vocab_size 32000, as
    # MoE Parallel Folding's runs do: a 0.1% difference in parameters)
    "mixtral-8x22b": {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
        "num_attention_heads": 48, "num_key_value_heads": 8, "vocab_size": 32768,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    # Qwen/Qwen2-57B-A14B: a 20,480-wide shared expert, qkv biases
    "qwen2-57b-a14b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": 3584, "intermediate_size": 18944, "moe_intermediate_size": 2560,
        "shared_expert_intermediate_size": 20480, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 151936,
        "num_experts": 64, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    },
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    # deepseek-ai/DeepSeek-V2-Lite: MLA without a query latent, 2 shared + 64 routed experts, the
    # first layer dense, greedy top-6
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "vocab_size": 102400, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
    },
    # deepseek-ai/DeepSeek-V3: MLA, 1 shared + 256 routed experts, the first 3 layers dense,
    # node-limited routing (8 groups, 4 per token)
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "vocab_size": 129280, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    },
}  # fmt: skip
# Read with the readers their families' plan_shape uses, not through the registry: importing the
# planner (every command's parser lists the presets) must not load the installed families, whose
# imports are plugins' code, before the command's signal handling is in place.
PRESETS.update(
    {
        name: ModelShape(name=name, **(llama_layout(cfg, name) | mla_fields(cfg, name)))
        for name, cfg in _MOE_CONFIGS.items()
    }
)


# Where a checkpoint of ours keeps its manifest: NeMo 2's context/, beside the iterations of a
# Megatron-LM or Megatron-Bridge root (porting/convert/layouts; the planner reads no torch).
MANIFESTS = ("context/porting.json", "porting/porting.json")


def checkpoint_manifest(path: Path) -> Path | None:
    """The manifest of the checkpoint directory ``path``, or None where it is not one of ours."""
    return next((path / m for m in MANIFESTS if (path / m).is_file()), None)


def load_model(spec: str | Path) -> ModelShape:
    """A shape from a preset name, an HF ``config.json`` (or its directory), or a checkpoint.

    A checkpoint written by ``porting import`` keeps the original HF config in its manifest
    (key ``hf_config``; :data:`MANIFESTS`); that is what is read.
    """
    text = str(spec)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if not path.exists():
        raise PortingError(
            f"--model {text}: no such file or directory, and not a preset "
            f"(presets: {', '.join(sorted(PRESETS))})"
        )
    if path.is_dir():
        manifest = checkpoint_manifest(path)
        if manifest is not None:
            data = _read_json(manifest)
            if not isinstance(data, dict) or "hf_config" not in data:
                raise PortingError(f"{manifest}: missing field hf_config")
            return from_hf_config(data["hf_config"], f"{manifest}: hf_config", path.name)
        path = path / "config.json"
        if not path.is_file():
            raise PortingError(
                f"--model {text}: a directory with neither config.json nor a checkpoint's "
                "manifest (context/porting.json, porting/porting.json)"
            )
    cfg = _read_json(path)
    if isinstance(cfg, dict):  # transformers 5's spelling read as 4.x's, as import reads it
        cfg = hf_spelling.internal(cfg, str(path))
    return from_hf_config(cfg, str(path), path.parent.name or path.name)


def _read_json(path: Path) -> object:
    return parse_json(read_text(path, str(path), MAX_CONFIG_BYTES), str(path))


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]
