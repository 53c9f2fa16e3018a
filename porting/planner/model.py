"""Model shapes for planning: read from an HF ``config.json``, an imported checkpoint or a preset.

Only the shape matters here (no weights). Sizes, parameter counts and FLOPs per token follow
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21, eq. 2 and 3), generalised to grouped-query attention, gated MLPs (SwiGLU),
untied output layers and Falcon's parallel attention+MLP block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

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
}


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer, as far as time and memory depend on it.

    ``gated`` is a SwiGLU-style MLP (``fc1`` produces gate and up, ``2 * ffn`` wide);
    ``parallel_attn`` is Falcon's block where attention and MLP read the same normed input
    (one shared norm when ``norms_per_layer`` is 1). ``learned_positions`` is the size of a
    learned absolute position table (GPT-2/3 style), 0 for rotary or ALiBi.
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

    def __post_init__(self) -> None:
        for field_name, accepted in SHAPE_LIMITS.items():
            if field_name != "head_dim" or self.head_dim:
                accepted.check(getattr(self, field_name), f"model {self.name}: {field_name}")
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
        # asked for several times by every layout the search predicts
        object.__setattr__(self, "_matmul_params", self._count_matmul_params())

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

    def _count_matmul_params(self) -> int:
        attn = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        mlp = self.hidden * self.ffn * (2 if self.gated else 1) + self.ffn * self.hidden
        return attn + mlp

    def params_per_layer(self) -> int:
        """All parameters of one block: linear weights, their biases and the norms."""
        n = self.matmul_params_per_layer()
        if self.bias:
            n += self.q_width + 2 * self.kv_width + self.hidden
            n += self.ffn * (2 if self.gated else 1) + self.hidden
        n += self.norms_per_layer * self.hidden * (2 if self.layernorm else 1)
        return n

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
        n = self.layers * self.params_per_layer() + self.embedding_params(tp) + final_norm
        if not self.tied:
            n += self.padded_vocab(tp) * self.hidden
        return n

    def model_flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token without recomputation: 6N + attention + logits.

        Narayanan et al. eq. 3 divided by the tokens of a batch and by 4/3 (their count includes
        the recomputed forward): ``72 l h^2 (1 + s/(6h)) + 6 h V`` for GPT, i.e. 6 x matmul
        weights of the blocks, ``12 l s (heads x head_dim)`` for QK^T and PV over the full
        (non-causal) square, and ``6 h V`` for the logits. MFU uses this count.
        """
        per_layer = 6 * self.matmul_params_per_layer() + 12 * seq_length * self.q_width
        return self.layers * per_layer + 6 * self.hidden * self.vocab


def _count(value: object, field_name: str, source: str, shape_field: str) -> int:
    """``value`` of the HF field ``field_name`` if it is within the ceiling of ``shape_field``."""
    return int(SHAPE_LIMITS[shape_field].check(value, f"{source}: {field_name}"))


def _need(cfg: dict, source: str, shape_field: str, *names: str) -> int:
    """The first of ``names`` present in ``cfg`` (HF configs rename fields across versions)."""
    for name in names:
        if name in cfg and cfg[name] is not None:
            return _count(cfg[name], name, source, shape_field)
    raise PortingError(f"{source}: missing field {names[0]}")


def _is_falcon_layout(cfg: dict) -> bool:
    # Chosen by config fields, never by the model's name (STYLE.md rule 6).
    return any(k in cfg for k in ("multi_query", "new_decoder_architecture", "parallel_attn"))


_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def from_hf_config(cfg: dict, source: str = "config.json", name: str | None = None) -> ModelShape:
    """Build a shape from an HF ``config.json`` dict (Llama-style or Falcon-style fields)."""
    if not isinstance(cfg, dict):
        raise PortingError(f"{source}: expected a JSON object")
    name = name or source
    experts = next((cfg[k] for k in _EXPERT_FIELDS if cfg.get(k)), None)
    if experts:
        # Refused rather than planned as a dense model: its FLOPs, memory and all-to-all traffic
        # would all be wrong.
        raise PortingError(
            f"{source}: a mixture-of-experts model ({show(experts)} experts); the planner's time "
            "and memory model covers dense decoders only, and expert parallelism is not in its "
            "search"
        )
    hidden = _need(cfg, source, "hidden", "hidden_size", "n_embed")
    layers = _need(cfg, source, "layers", "num_hidden_layers", "n_layer")
    heads = _need(cfg, source, "heads", "num_attention_heads", "n_head")
    vocab = _need(cfg, source, "vocab", "vocab_size")
    head_dim = cfg.get("head_dim") or 0
    if head_dim:
        head_dim = _count(head_dim, "head_dim", source, "head_dim")
    if _is_falcon_layout(cfg):
        # transformers' FalconConfig / modeling_falcon.py: MQA for 7B, num_kv_heads groups for
        # the new decoder architecture (40B/180B/11B), MHA for the RW layout.
        new_arch = bool(cfg.get("new_decoder_architecture", False))
        if new_arch:
            kv = _count(cfg.get("num_kv_heads", heads), "num_kv_heads", source, "kv_heads")
        elif cfg.get("multi_query", True):
            kv = 1
        else:
            kv = heads
        ffn = cfg.get("ffn_hidden_size") or 4 * hidden
        ffn = _count(ffn, "ffn_hidden_size", source, "ffn")
        parallel = bool(cfg.get("parallel_attn", True)) or new_arch
        if new_arch:
            norms = 1 if cfg.get("num_ln_in_parallel_attn") == 1 else 2
        else:
            norms = 1 if parallel else 2
        return ModelShape(
            name=name,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv,
            ffn=ffn,
            vocab=vocab,
            tied=bool(cfg.get("tie_word_embeddings", True)),
            gated=False,
            head_dim=head_dim,
            parallel_attn=parallel,
            norms_per_layer=norms,
            layernorm=True,
            bias=bool(cfg.get("bias", False)),
        )
    kv = cfg.get("num_key_value_heads")
    kv = heads if kv is None else _count(kv, "num_key_value_heads", source, "kv_heads")
    act = str(cfg.get("hidden_act", "silu"))
    return ModelShape(
        name=name,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv,
        ffn=_need(cfg, source, "ffn", "intermediate_size"),
        vocab=vocab,
        tied=bool(cfg.get("tie_word_embeddings", False)),
        gated=act in ("silu", "swiglu", "swish"),
        head_dim=head_dim,
        bias=bool(cfg.get("attention_bias", False) or cfg.get("mlp_bias", False)),
        dropout=bool(cfg.get("attention_dropout", 0.0) or cfg.get("hidden_dropout", 0.0)),
    )


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


def load_model(spec: str | Path) -> ModelShape:
    """A shape from a preset name, an HF ``config.json`` (or its directory), or a checkpoint.

    A checkpoint written by ``porting import`` keeps the original HF config under
    ``context/porting.json`` (key ``hf_config``); that is what is read.
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
        manifest = path / "context" / "porting.json"
        if manifest.is_file():
            data = _read_json(manifest)
            if not isinstance(data, dict) or "hf_config" not in data:
                raise PortingError(f"{manifest}: missing field hf_config")
            return from_hf_config(data["hf_config"], f"{manifest}: hf_config", path.name)
        path = path / "config.json"
        if not path.is_file():
            raise PortingError(
                f"--model {text}: a directory with neither config.json nor context/porting.json"
            )
    return from_hf_config(_read_json(path), str(path), path.parent.name or path.name)


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
