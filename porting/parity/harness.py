"""The parity harness: the same prompts through HF and through Megatron, full logits compared.

Prompts are fixed: texts of several lengths through the checkpoint's own tokenizer, plus one
seeded sequence of random token ids spanning the whole vocabulary. Every position of every prompt
is compared (no means, no samples). The gate is ``torch.testing.assert_close``'s criterion,
``|hf - mc| <= atol + rtol * |mc|`` element-wise, plus a minimum top-1 agreement.
"""

from __future__ import annotations

import gc
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from porting import quiet
from porting.convert.container import reference_architecture
from porting.parity.floor import FLOOR_MIN_S, format_rate, format_seconds, format_work
from porting.parity.streamed import LAYER_RTOL

if TYPE_CHECKING:
    from porting.convert.hf_files import HFSource

log = logging.getLogger(__name__)

PROMPT_TEXTS = (
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "東京は日本の首都です。Megatron and NeMo train large language models across many GPUs, "
    "while Hugging Face transformers is where most checkpoints are shared and evaluated.",
)
RANDOM_PROMPT_LEN = 64
# A sliding window acts only on a prompt longer than it: the random prompt becomes window +
# WINDOW_MARGIN tokens (the last WINDOW_MARGIN positions each lose keys) where that is at most
# LONG_PROMPT_MAX and max_position_embeddings, and where its cost stays in budget: the matmul work
# it adds on both sides, and the padded batch's attention scores (every prompt is padded to the
# longest), per layer (eager attention holds about three such tensors at once) and over all layers
# (about ten passes over each on each side: the gate's time, ~20 s for 3.2 GiB on 2 CPU cores). A 7B
# with a 4096 window would add ~1e14 FLOP (15-20 min on a CPU) and 8.7 GB of scores a layer: the
# report names its window instead (docs/conversion.md, "What the gate could not see").
LONG_PROMPT_MAX = 8192
WINDOW_MARGIN = 16
LONG_PROMPT_FLOP = 1e13
LONG_PROMPT_SCORE_BYTES = 2 * 2**30
LONG_PROMPT_SCORE_TOTAL = 16 * 2**30
DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-4
DEFAULT_MIN_TOP1 = 0.999


@dataclass
class ParityReport:
    """Full-logit comparison over all positions of all prompts."""

    prompts: int
    positions: int
    vocab_size: int
    max_abs_diff: float
    mean_abs_diff: float
    kl_hf_mcore: float
    top1_agreement: float
    atol: float
    rtol: float
    min_top1: float
    worst_excess: float
    passed: bool
    mode: str = "whole-model"
    layers: list[dict] = field(default_factory=list)
    first_divergent_layer: int | None = None
    # NaN / Inf logit values per side; any fails the gate, whatever the differences say.
    nonfinite_hf: int = 0
    nonfinite_megatron: int = 0
    # What the gate cost: where it ran, its wall time (from reading the inputs to the verdict),
    # and its floor, both sides' matmuls at this machine's fp32 rate (measured once and cached,
    # porting.parity.floor; layer-streamed). The summary gives the ratio from a floor of
    # FLOOR_MIN_S up only (below it the gate's fixed costs are what it measures).
    device: str = "cpu"
    wall_s: float | None = None
    floor_s: float | None = None
    floor_ratio: float | None = None
    matmul_tflop: float | None = None
    matmul_gflops: float | None = None
    # Each process's share of a layer-streamed gate (streamed.GateCost.ranks): its layers, CPU
    # and wall seconds; one entry in one process, one a rank where the ranks split the layers.
    ranks: list[dict] = field(default_factory=list)
    # The mapped features the prompts could not see (``{"field", "value", "why"}`` each, see
    # :func:`unobserved_features`): a conversion that dropped one would pass all the same.
    unobserved: list[dict] = field(default_factory=list)
    # Each multi-token-prediction layer's logits, compared as the main logits are
    # (``{"layer", "max_abs_diff", "top1_agreement", "passed"}``, porting.parity.mtp); the verdict
    # needs every one to pass.
    mtp: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        """JSON-ready dict: strict JSON, a non-finite number (NaN, Inf) becomes ``null`` (the
        ``nonfinite_*`` counts say why)."""
        return _finite(asdict(self))

    def _layers_line(self) -> str:
        """How many layers streamed, how many left the tolerance on their own input (each of
        those ran again on the HF layer's input), and the largest own error."""

        def rel(value) -> float:  # NaN and Inf (null in a child's JSON) are the worst
            return value if isinstance(value, float | int) and math.isfinite(value) else math.inf

        n = len(self.layers)
        past = sum(not rel(d["max_rel"]) <= LAYER_RTOL for d in self.layers)
        worst = max(self.layers, key=lambda d: rel(d["own_max_rel"]))
        value = worst["own_max_rel"]
        largest = f"{math.nan if value is None else value:.1e}, layer {worst['layer']}"
        if not past:
            return f"{n} streamed, each within {LAYER_RTOL:g} on its own input (largest {largest})"
        return (
            f"{n} streamed, {past} past {LAYER_RTOL:g} on their own input, each run again on "
            f"the HF layer's (largest own error {largest})"
        )

    def summary(self) -> str:
        """Human-readable one-block summary."""
        verdict = "PASS" if self.passed else "FAIL"
        text = (
            f"parity {verdict}: {self.prompts} prompts, {self.positions} positions, "
            f"vocab {self.vocab_size}"
        )
        if self.unobserved:
            n = len(self.unobserved)
            text += f"; {n} mapped feature{'s' * (n > 1)} the prompts could not see (below)"
        text += "\n"
        if self.nonfinite_hf or self.nonfinite_megatron:
            text += (
                f"  NOT FINITE     {self.nonfinite_hf} NaN/Inf logit values from HF, "
                f"{self.nonfinite_megatron} from Megatron (a weight holds NaN/Inf, or overflows)\n"
            )
        text += (
            f"  max |dlogit|   {self.max_abs_diff:.3e}   (gate: atol {self.atol:g} + rtol "
            f"{self.rtol:g} * |logit|)\n"
            f"  mean |dlogit|  {self.mean_abs_diff:.3e}\n"
            f"  KL(HF||Mcore)  {self.kl_hf_mcore:.3e}\n"
            f"  top-1 agree    {100 * self.top1_agreement:.2f}%   (gate: >= {100 * self.min_top1:.1f}%)"
        )
        if self.layers:
            text += f"\n  layers         {self._layers_line()}"
        for m in self.mtp:
            text += (
                f"\n  MTP layer {m['layer']:<4} max |dlogit| {m['max_abs_diff']:.3e}, top-1 "
                f"{100 * m['top1_agreement']:.2f}%{'' if m['passed'] else ': FAIL'}"
            )
        if self.wall_s is not None:
            text += f"\n  gate           {format_seconds(self.wall_s)} on {self.device}"
            if self.floor_s and self.matmul_gflops:
                text += (
                    f"; floor {format_seconds(self.floor_s)} ({format_work(self.matmul_tflop)} "
                    f"of matmul at {format_rate(self.matmul_gflops)})"
                )
                if self.floor_s >= FLOOR_MIN_S and self.floor_ratio is not None:
                    text += f": {self.floor_ratio:.1f}x"
                else:
                    text += (
                        f"; no ratio under a {FLOOR_MIN_S:g} s floor: fixed costs, not matmuls, "
                        "set the time"
                    )
        if len(self.ranks) > 1:
            shares = ", ".join(
                f"{r['rank']}: layers {r['layers'][0]}-{r['layers'][1]} {r['cpu_s']:.1f} CPU-s"
                if r["layers"]
                else f"{r['rank']}: no layer"
                for r in self.ranks
            )
            text += f"\n  ranks          {shares}"
        if self.first_divergent_layer is not None:
            d = self.layers[self.first_divergent_layer]
            text += (
                f"\n  first divergence at layer {d['layer']}: max |d hidden| "
                f"{d['own_max_abs']:.1e} ({d['own_max_rel']:.1e} relative, on the HF layer's "
                f"input; fp32 explains up to {LAYER_RTOL:g})"
            )
        for u in self.unobserved:
            text += f"\n  not seen       {u['why']}"
        return text


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def build_prompts(tokenizer, vocab_size: int, seed: int = 0, config=None) -> list[torch.Tensor]:
    """The fixed prompts as ``[1, seq]`` id tensors (text prompts plus one random-id prompt).

    ``config`` (the ``transformers`` config of the HF side, :func:`reference_config`): a sliding
    window that no prompt passes makes the random prompt longer than it, where
    :func:`long_prompt_len` allows.
    """
    prompts = []
    for text in PROMPT_TEXTS:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"] if tokenizer else []
        if ids:
            prompts.append(torch.tensor([ids], dtype=torch.long))
    g = torch.Generator().manual_seed(seed)
    length = RANDOM_PROMPT_LEN
    longest = max([length, *(p.shape[1] for p in prompts)])
    window = sliding_window_of(config) if config is not None else None
    if window is not None and longest <= window:
        length = long_prompt_len(config) or length
    prompts.append(torch.randint(0, vocab_size, (1, length), generator=g))
    return prompts


def reference_config(family, hf_config: dict):
    """The ``transformers`` config the HF side computes with (its class's defaults filled in:
    Gemma 2's caps and window, Mistral's window, where ``config.json`` leaves them out)."""
    from porting.contract.hf_spelling import transformers_config

    return transformers_config(family.hf_class(hf_config["architectures"][0]), hf_config)


def sliding_window_of(config) -> int | None:
    """The window ``config``'s attention slides over, or None: none set, switched off
    (``use_sliding_window`` false) or used by no layer (``layer_types``)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if isinstance(types, list | tuple) and all(t == "full_attention" for t in types):
        return None
    return window


def long_prompt_len(config) -> int | None:
    """The random prompt's length that makes ``config``'s sliding window act (window +
    :data:`WINDOW_MARGIN`), or None: no window, one the default prompt already passes, or one
    :func:`_long_prompt` refuses (its reason)."""
    return _long_prompt(config)[0]


def _long_prompt(config, prompts: int = len(PROMPT_TEXTS) + 1) -> tuple[int | None, str]:
    """``(length, "")``, or ``(None, why no prompt passes the window)``."""
    window = sliding_window_of(config)
    if window is None or window + WINDOW_MARGIN <= RANDOM_PROMPT_LEN:
        return None, ""
    n = window + WINDOW_MARGIN
    positions = getattr(config, "max_position_embeddings", None)
    if n > LONG_PROMPT_MAX:
        return None, f"a prompt past it, {n} tokens, is over the gate's {LONG_PROMPT_MAX}"
    if isinstance(positions, int) and n > positions:
        return None, (
            f"a prompt past it, {n} tokens, would pass max_position_embeddings {positions}: "
            "the window never acts within the model's context"
        )
    flop, score_bytes = _long_prompt_cost(config, n, prompts)
    total = score_bytes * config.num_hidden_layers
    if (
        flop > LONG_PROMPT_FLOP
        or score_bytes > LONG_PROMPT_SCORE_BYTES
        or total > LONG_PROMPT_SCORE_TOTAL
    ):
        return None, (
            f"a prompt past it, {n} tokens, would add ~{flop:.1e} FLOP and "
            f"{score_bytes / 2**30:.2f} GiB of attention scores a layer ({total / 2**30:.0f} GiB "
            f"in all), over the gate's budget ({LONG_PROMPT_FLOP:.0e} FLOP, "
            f"{LONG_PROMPT_SCORE_BYTES / 2**30:g} GiB a layer, {LONG_PROMPT_SCORE_TOTAL / 2**30:g} "
            "GiB in all)"
        )
    return n, ""


def _long_prompt_cost(config, n: int, prompts: int) -> tuple[float, float]:
    """Both sides' matmul FLOP for ``n`` more positions (linear layers, the output head, and
    attention over the window), and the padded batch's attention scores of one layer in fp32."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ffn = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = (
        config.num_hidden_layers * (hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * ffn)
        + hidden * config.vocab_size
    )
    attention = config.num_hidden_layers * 2 * heads * head_dim * n * n
    flop = 2 * 2 * (per_token * n + attention)
    return flop, 4.0 * prompts * heads * n * n


def mapped_fields(family) -> set[str]:
    """The HF config fields the family's config map turns into Megatron fields (``Field`` and
    ``Derived`` entries; carried and no-op fields change nothing there)."""
    from porting.contract.config_map import Derived, Field

    names: set[str] = set()
    for entry in family.config_entries:
        if isinstance(entry, Field):
            names.add(entry.hf)
        elif isinstance(entry, Derived):
            names.update(entry.hf)
    return names


class SiteProbe(TorchFunctionMode):
    """While entered around the HF side's forward: the largest magnitude that reached the sites
    where a mapped feature acts inside the layers, so that the report can say which features the
    prompts left unbent (:func:`unobserved_features`). Computes nothing differently.

    ``attention_tanh``: the largest |input| of ``torch.tanh`` on a 4-D tensor (the attention
    scores over the soft-cap, ``[b, heads, q, k]``; transformers' ``eager_attention_forward``).
    ``gelu``: the largest |input| of ``torch.nn.functional.gelu`` (exact or tanh). None where no
    such call ran (another attention implementation): nothing is then claimed from it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.attention_tanh: float | None = None
        self.gelu: float | None = None
        # which GELU ran ("gelu" exact, "gelu_pytorch_tanh"): of two config fields naming one
        # each (Gemma-7B's), only the one the reference computes is its feature
        self.gelu_variants: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # the function first: asking every call's input for its size and dtype is two more calls
        # through the modes below this one (a DeepSeek-V3 gate makes 55,000 calls)
        if func in _PROBED and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            if x.numel() and x.is_floating_point():
                if func is not torch.nn.functional.gelu:
                    if x.dim() == 4:
                        self.attention_tanh = _larger(self.attention_tanh, x)
                else:
                    self.gelu = _larger(self.gelu, x)
                    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
                    self.gelu_variants.add(GELU_VARIANTS[int(approximate == "tanh")])
        return func(*args, **kwargs)


_PROBED = frozenset({torch.tanh, torch.Tensor.tanh, torch.nn.functional.gelu})


def _larger(current: float | None, x: torch.Tensor) -> float:
    lo, hi = torch.aminmax(x.detach())
    return max(current or 0.0, -lo.item(), hi.item())


@dataclass
class Sight:
    """What the gate's HF pass reached, which the rules of :data:`UNSEEN` judge: the reference
    config, the prompts' lengths, HF's logits (after any final cap) and the sites' magnitudes."""

    config: object
    prompt_lengths: list[int]
    logits: list[torch.Tensor]
    probe: SiteProbe | None
    atol: float
    rtol: float

    def tolerance(self, value: float) -> float:
        """The gate's tolerance for a value of magnitude ``value``."""
        return self.atol + self.rtol * abs(value)


def _window_unseen(sight: Sight, name: str) -> str | None:
    window = sliding_window_of(sight.config)
    longest = max(sight.prompt_lengths)
    if window is None or longest > window:
        return None
    _, why_short = _long_prompt(sight.config, len(sight.prompt_lengths))
    why_short = f"; {why_short}" if why_short else ""
    if name == "sliding_window":
        head = f"sliding_window={window}"
    else:
        types = getattr(sight.config, name, None)
        if not isinstance(types, list | tuple):
            return None
        sliding = sum(t != "full_attention" for t in types)
        head = f"{name} ({sliding} of {len(types)} layers sliding, window {window})"
    return (
        f"{head}: the longest prompt is {longest} tokens, so no position has a key outside the "
        f"window{why_short}"
    )


def _long_rope_unseen(sight: Sight, name: str) -> str | None:
    scaling = getattr(sight.config, name, None)
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    original = getattr(sight.config, "original_max_position_embeddings", None)
    if kind not in ("longrope", "su") or not isinstance(original, int):
        return None
    longest = max(sight.prompt_lengths, default=0)
    if longest > original:
        return None
    # transformers switches to long_factor only past original_max_position_embeddings (4096 on
    # the 128k Phi-3 releases): prompts that long would make the gate cost what a long-context
    # evaluation does
    return (
        f"{name} ({kind}): the longest prompt is {longest} tokens, within "
        f"original_max_position_embeddings={original}, so only short_factor was used; "
        "long_factor and the switch to it were not compared"
    )


def _final_cap_unseen(sight: Sight, name: str) -> str | None:
    cap = getattr(sight.config, name, None)
    if not isinstance(cap, int | float) or isinstance(cap, bool) or not cap > 0:
        return None
    y = torch.cat([t.reshape(-1) for t in sight.logits]).double().abs()
    if not bool(torch.isfinite(y).all()) or y.max().item() >= cap:
        return None
    # HF's logits are capped: y = c tanh(x / c), so x = c atanh(y / c), and a conversion that
    # dropped the cap would give x where HF gives y. Seen only where |x - y| exceeds the gate's
    # tolerance at some logit (atol + rtol * |x|, the Megatron side's magnitude).
    x = cap * torch.atanh(y / cap)
    bend = x - y
    if (bend - (sight.atol + sight.rtol * x)).max().item() > 0:
        return None
    top = int(y.argmax())
    return (
        f"{name}={cap:g}: the largest |logit| was {y[top].item():.3g} ({x[top].item():.3g} "
        f"before the cap), where the cap changes logits by at most {bend.max().item():.1e}, "
        f"inside the tolerance (atol {sight.atol:g} + rtol {sight.rtol:g} * |logit|)"
    )


def _attention_cap_unseen(sight: Sight, name: str) -> str | None:
    cap = getattr(sight.config, name, None)
    if not isinstance(cap, int | float) or isinstance(cap, bool) or not cap > 0:
        return None
    if sight.probe is None or sight.probe.attention_tanh is None:
        return None  # no measurement, no claim
    score = cap * sight.probe.attention_tanh  # the probe saw score / cap
    bend = score - cap * math.tanh(score / cap)
    if bend > SITE_MARGIN * sight.tolerance(score):
        return None
    return (
        f"{name}={cap:g}: the largest |attention score| before the cap was {score:.3g}, where "
        f"the cap changes scores by at most {bend:.1e}, within {SITE_MARGIN}x the gate's "
        f"tolerance (atol {sight.atol:g} + rtol {sight.rtol:g} * |score|): too little to be "
        "sure it reaches the logits"
    )


GELU_VARIANTS = ("gelu", "gelu_pytorch_tanh")


def gelu_gap(bound: float) -> float:
    """The largest ``|gelu(x) - gelu_tanh(x)|`` over ``|x| <= bound``, on a fine float64 grid
    (the difference is even: both GELUs satisfy ``f(-x) = f(x) - x``; its largest anywhere is
    4.7e-4, near ``|x| = 2.7``)."""
    import torch.nn.functional as F

    x = torch.linspace(0.0, bound, 20001, dtype=torch.float64)
    return (F.gelu(x) - F.gelu(x, approximate="tanh")).abs().max().item()


def _gelu_unseen(sight: Sight, name: str) -> str | None:
    act = getattr(sight.config, name, None)
    if act not in GELU_VARIANTS or sight.probe is None or sight.probe.gelu is None:
        return None
    if act not in sight.probe.gelu_variants:
        return None  # the field the reference class does not read (Gemma-7B's hidden_activation)
    bound = sight.probe.gelu
    gap = gelu_gap(bound)
    if gap > SITE_MARGIN * sight.tolerance(bound):
        return None
    return (
        f"{name}={act}: the largest |input| to the activation was {bound:.3g}, where exact and "
        f"tanh GELU differ by at most {gap:.1e}, within {SITE_MARGIN}x the gate's tolerance "
        f"(atol {sight.atol:g} + rtol {sight.rtol:g} * |input|): too little to be sure it "
        "reaches the logits"
    )


# HF field -> rule(sight, field) -> why the gate's prompts could not see it, or None (seen, absent,
# or nothing measured to say otherwise). A window is judged by the prompts' lengths against it and
# the final cap from HF's own logits: both exact (a conversion without them gives logits within the
# tolerance exactly when named). The attention cap and the GELU variant are judged where they act,
# by the largest magnitude that reached them; what a change there does to the logits depends on the
# layers after it (a GELU change reaches a tiny Gemma 2's logits 1.7x smaller, a tiny Gemma's,
# without the post-MLP norm, 60x smaller), so they are named unless their change at that site is
# over SITE_MARGIN times the tolerance. That names a GELU variant at any size (exact and tanh GELU
# never differ by more than 4.7e-4) unless the gate's tolerance is under about 5e-6.
# LongRoPE's long table is named when no prompt passes original_max_position_embeddings (it is then
# never used). rope_theta, the other rope_scaling kinds and query_pre_attn_scalar are never named:
# porting.proof's prove_features_observed measures them (and these rules) on tiny models by
# perturbing the config.
SITE_MARGIN = 100
UNSEEN = {
    "sliding_window": _window_unseen,
    "layer_types": _window_unseen,
    "attn_logit_softcapping": _attention_cap_unseen,
    "final_logit_softcapping": _final_cap_unseen,
    "hidden_activation": _gelu_unseen,
    "hidden_act": _gelu_unseen,
    "rope_scaling": _long_rope_unseen,
}


def unobserved_features(sight: Sight, mapped: set[str], rules=None) -> list[dict]:
    """``{"field", "value", "why"}`` for each field of ``mapped`` that ``rules`` (default
    :data:`UNSEEN`) finds the gate's prompts did not bend (see :class:`Sight`)."""
    out = []
    for name, rule in (UNSEEN if rules is None else rules).items():
        if name not in mapped:
            continue
        why = rule(sight, name)
        if why is not None:
            value = getattr(sight.config, name, None)
            if isinstance(value, tuple):
                value = list(value)
            out.append({"field": name, "value": _finite(value), "why": why})
    return out


# float64 bytes of one block of positions compared at a time: the comparison's temporaries (the
# difference, both log-softmaxes) are a few times a block, not a few times every position's
# logits (at a vocabulary of 202,048 and 238 positions those are 385 MB each in float64)
COMPARE_BYTES = 32 << 20


def _blocks(hf: list[torch.Tensor], mc: list[torch.Tensor], rows: int):
    """``(hf block, mc block)`` of up to ``rows`` positions, prompt by prompt, in float64."""
    for a, b in zip(hf, mc, strict=True):
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        for start in range(0, a.shape[0], rows):
            yield a[start : start + rows].double(), b[start : start + rows].double()


def compare(
    hf: list[torch.Tensor],
    mc: list[torch.Tensor],
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    min_top1: float = DEFAULT_MIN_TOP1,
) -> ParityReport:
    """Compare per-prompt logits ``[1, seq, vocab]`` (Megatron's already cut to the HF
    vocabulary), a block of positions at a time (:data:`COMPARE_BYTES`): each figure is a
    maximum, a sum or a count over positions, so the blocks give the whole's."""

    def shape(logits: list[torch.Tensor]) -> tuple[int, int]:
        width = {t.shape[-1] for t in logits}
        return sum(t.numel() // t.shape[-1] for t in logits), width.pop() if len(width) == 1 else -1

    if shape(hf) != shape(mc) or len(hf) != len(mc) or -1 in shape(hf):
        raise ValueError(f"logit shapes differ: HF {shape(hf)} vs Megatron {shape(mc)}")
    positions, vocab = shape(hf)
    maxima, excesses = [], []
    total = kl = agree = bad_hf = bad_mc = 0.0
    for a, b in _blocks(hf, mc, max(1, COMPARE_BYTES // (8 * max(vocab, 1)))):
        diff = (a - b).abs()
        maxima.append(diff.max())
        excesses.append((diff - (atol + rtol * b.abs())).max())
        total += diff.sum().item()
        logp = torch.log_softmax(a, -1)
        logq = torch.log_softmax(b, -1)
        kl += (logp.exp() * (logp - logq)).sum().item()
        bad_a, bad_b = ~torch.isfinite(a), ~torch.isfinite(b)
        # argmax takes NaN for the largest value: two all-NaN rows would "agree" at index 0.
        # Only positions finite on both sides can agree.
        rows = ~(bad_a.any(-1) | bad_b.any(-1))
        agree += ((a.argmax(-1) == b.argmax(-1)) & rows).sum().item()
        bad_hf += bad_a.sum().item()
        bad_mc += bad_b.sum().item()
    # max over the blocks' maxima keeps a NaN (Python's max would not)
    excess = torch.stack(excesses).max().item()
    finite = not (bad_hf or bad_mc)
    return ParityReport(
        prompts=len(hf),
        positions=positions,
        vocab_size=vocab,
        max_abs_diff=torch.stack(maxima).max().item(),
        mean_abs_diff=total / (positions * vocab),
        # never below 0 but by float64 rounding (-4e-18 on one distribution), which reads as a sign
        kl_hf_mcore=max(kl / positions, 0.0),
        top1_agreement=agree / positions,
        atol=atol,
        rtol=rtol,
        min_top1=min_top1,
        worst_excess=excess,
        passed=finite and excess <= 0 and agree / positions >= min_top1,
        nonfinite_hf=int(bad_hf),
        nonfinite_megatron=int(bad_mc),
    )


@torch.no_grad()
def hf_logits(
    hf_dir: str | Path,
    hf_model_class: str | type,
    prompts: list[torch.Tensor],
    attn_implementation: str = "eager",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Logits of the HF model (fp32 on the CPU by default) for each prompt, as fp32 on the CPU;
    frees the model after.

    ``attn_implementation`` is the family's choice (:attr:`Family.hf_attn_implementation`).
    ``device`` and ``dtype`` let the GPU check run HF's own bf16 next to ours.
    """
    import transformers

    from porting.contract.hf_spelling import config_for_reference
    from porting.convert.container import reference_config
    from porting.convert.hf_files import read_container, read_hf_config_as_written

    cls = (
        getattr(transformers, hf_model_class) if isinstance(hf_model_class, str) else hf_model_class
    )
    hf_config, written = read_hf_config_as_written(hf_dir)
    held = read_container(hf_dir)
    if held is not None:  # the container class, its text config as import read it
        model = cls.from_pretrained(
            str(hf_dir),
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            config=reference_config(cls, held, hf_config),
        )
    elif "quantization_config" in hf_config:
        from porting.parity.hf_dequant import load_whole

        model = load_whole(hf_dir, cls, attn_implementation).to(dtype)
    else:
        # a config spelled by transformers 5 reaches the installed transformers in the 4.x
        # spelling, which both read alike (porting.contract.hf_spelling)
        config = config_for_reference(cls, hf_config, written)
        spelled = {} if config is None else {"config": config}
        model = cls.from_pretrained(
            str(hf_dir),
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            **spelled,
        )
    model.to(device).eval()
    out = [model(p.to(device)).logits.float().cpu() for p in prompts]
    del model
    gc.collect()
    return out


def megatron_logits_from_checkpoint(
    ckpt,
    prompts: list[torch.Tensor],
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Logits of the Megatron model loaded from ``ckpt`` (a path or an opened
    :class:`~porting.convert.checkpoint.Checkpoint`; cast to ``dtype``, fp32 by default), cut
    to the HF vocabulary. The model lives where Megatron builds it: the GPU when CUDA is visible."""
    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.megatron import init_parallel, load_mcore_from_checkpoint, mcore_logits

    ckpt = open_checkpoint(ckpt)
    family = family_by_name(ckpt.family)
    init_parallel()
    model, _ = load_mcore_from_checkpoint(ckpt, family, dtype=dtype)
    out = [mcore_logits(model, p)[..., :vocab_size] for p in prompts]
    del model
    gc.collect()
    return out


def verify(
    hf_dir: HFSource | str | Path,
    ckpt,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    min_top1: float = DEFAULT_MIN_TOP1,
    whole_model: bool = False,
    show_progress: bool = False,
    allow_pickle: bool = False,
    scratch_dir: str | Path | None = None,
    device: str = "cpu",
) -> ParityReport:
    """Run the parity check of an HF directory against one of our checkpoints (``ckpt``: a path,
    or the :class:`~porting.convert.checkpoint.Checkpoint` the caller opened).

    By default layer-streamed (:mod:`porting.parity.streamed`): two decoder layers of one side in
    memory at a time, per-layer divergence reported and the first diverging layer named. With
    ``whole_model`` both models are loaded whole (never together: Megatron first, then HF).
    ``scratch_dir``: see :func:`porting.parity.streamed.streamed_logits`. ``device``: ``cpu``,
    or ``cuda`` for the layers streamed to the device (in a child process when this one has hidden
    its GPUs for a conversion); a device that runs out of memory hands the gate to the CPU, with
    one line on stderr, and the verdict is the CPU's.
    """

    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.hf_files import HFSource, read_hf_config_as_written  # noqa: F811
    from porting.parity.pair import check_pair

    # Opened once (layout, manifest; the HF directory's config where the caller read it:
    # porting.convert.hf_files.HFSource) and handed down; a child process opens both by path.
    checkpoint = open_checkpoint(ckpt)
    ckpt = checkpoint.path
    hf = hf_dir if isinstance(hf_dir, HFSource) else None
    hf_dir = hf.path if hf is not None else Path(hf_dir)
    if torch.device(device).type != "cpu":
        from porting import cpu

        if not cpu.cuda_available():  # hidden from this process for the conversion
            return _verify_in_child(hf_dir, ckpt, device, locals())
    manifest = checkpoint.manifest
    # A wrong pair is refused on the configs alone, before NeMo and Megatron load.
    hf_config = check_pair(hf or hf_dir, checkpoint)
    written = hf.as_written if hf is not None else read_hf_config_as_written(hf_dir)[1]
    family = family_by_name(manifest.family)
    # its Megatron side (and NeMo, for a family with no NeMo-free config): start-up, not the gate
    family.config_class(nemo=False)
    family.hf_class(reference_architecture(manifest))
    from megatron.core.models.gpt import gpt_layer_specs, gpt_model  # noqa: F401

    quiet.quiet_nemo(load=False)
    started = time.perf_counter()
    source, ctx, reference, prompts = _gate_inputs(
        checkpoint, family, hf_config, hf, hf_dir, allow_pickle, device, whole_model
    )
    probe = SiteProbe()
    if whole_model:
        hf, report = _whole_model(checkpoint, family, hf_dir, prompts, probe, device, atol, rtol,
                                  min_top1)  # fmt: skip
    else:
        from porting.convert.megatron import init_parallel
        from porting.parity.streamed import streamed_logits

        init_parallel()
        try:
            hf, mc, layers, cost, mtp = streamed_logits(
                hf_dir,
                checkpoint,
                family,
                prompts,
                manifest.vocab_size,
                show_progress,
                allow_pickle,
                scratch_dir,
                device,
                hf_probe=probe,
                hf_read=(hf_config, source, written),
            )
        except torch.OutOfMemoryError as err:
            if torch.device(device).type == "cpu":
                raise
            print(
                f"parity: the {device} device ran out of memory "
                f"({str(err).splitlines()[0][:160]}); running the gate on the CPU instead",
                file=sys.stderr,
                flush=True,
            )
            torch.cuda.empty_cache()
            return _verify_in_child(hf_dir, ckpt, "cpu", locals())
        report = _streamed_report(hf, mc, layers, cost, mtp, atol, rtol, min_top1)
    report.unobserved = _unobserved(
        reference, prompts, hf, probe, atol, rtol, family, ctx, whole_model
    )
    report.device = torch.device(device).type
    report.wall_s = time.perf_counter() - started
    if report.floor_s:
        report.floor_ratio = report.wall_s / report.floor_s
    log.debug("%s", report.summary())
    return report


def _gate_inputs(
    checkpoint, family, hf_config: dict, hf, hf_dir: Path, allow_pickle: bool, device: str,
    whole_model: bool,
):  # fmt: skip
    """What the gate compares, each checked before either model is built: the HF weights as the
    reference dequantizes them, the shape context of what the checkpoint stores, the reference
    config and the prompts."""
    from porting.convert.checkpoint import tokenizer_files
    from porting.convert.hf_files import load_tokenizer
    from porting.convert.layouts import check_saved_metadata
    from porting.convert.megatron import build_config
    from porting.convert.preflight import (
        as_stored,
        check_float_dtypes,
        check_gate_memory,
        check_hf_checkpoint,
    )
    from porting.convert.safetensors_io import hf_weights, weights_at
    from porting.parity.hf_dequant import REFERENCE

    manifest = checkpoint.manifest
    # Not read here, but a checkpoint whose metadata would run code on load is hostile.
    check_saved_metadata(checkpoint, family)
    # The HF side's config against its headers before either model is built (the Megatron
    # side's is checked as its config is rebuilt, checkpoint_config).
    # a quantized checkpoint's weights as the reference dequantizes them, not as the import did
    if hf is not None:
        source = hf_weights(hf, allow_pickle=allow_pickle, dequantizer=REFERENCE)
    else:
        source = weights_at(hf_dir, allow_pickle=allow_pickle, dequantizer=REFERENCE)
    check_float_dtypes(family, source)
    # an MTP count over a checkpoint that stores no MTP layer is read as 0, as import read it
    stored, _ = as_stored(
        family,
        hf_config,
        source.keys(),
        lambda cfg: build_config(family, cfg, torch.float32, vocab_divisor=1)[1],
    )
    _, ctx = build_config(family, stored, torch.float32, vocab_divisor=1)
    hf_shapes = check_hf_checkpoint(
        family, stored, ctx, source, Path(hf_dir) / "config.json", "verify"
    )
    if torch.device(device).type == "cpu":
        check_gate_memory("verify", hf_shapes, hf_config, whole_model)
    tok_files = tokenizer_files(checkpoint)
    tokenizer = load_tokenizer(tok_files[0].parent) if tok_files else None
    reference = reference_config(family, hf_config)
    prompts = build_prompts(tokenizer, manifest.vocab_size, config=reference)
    return source, ctx, reference, prompts


def _whole_model(checkpoint, family, hf_dir, prompts, probe, device, atol, rtol, min_top1):
    """Both models whole, never together (Megatron first, then HF): the HF logits and the report."""
    manifest = checkpoint.manifest
    mc = megatron_logits_from_checkpoint(checkpoint, prompts, manifest.vocab_size)
    hf_cls = family.hf_class(reference_architecture(manifest))
    with probe:
        hf = hf_logits(hf_dir, hf_cls, prompts, family.hf_attn_implementation, device=device)
    return hf, compare(hf, mc, atol=atol, rtol=rtol, min_top1=min_top1)


def _streamed_report(hf, mc, layers, cost, mtp, atol, rtol, min_top1) -> ParityReport:
    """The layer-streamed gate's report: the logits compared, the MTP layers' too, its cost and
    floor, each layer's divergence and the first that diverges."""
    report = compare(hf, mc, atol=atol, rtol=rtol, min_top1=min_top1)
    for k, (hf_k, mc_k) in enumerate(mtp):
        r = compare(hf_k, mc_k, atol=atol, rtol=rtol, min_top1=min_top1)
        report.mtp.append(
            {
                "layer": k,
                "max_abs_diff": r.max_abs_diff,
                "top1_agreement": r.top1_agreement,
                "passed": r.passed,
            }
        )
        report.passed = report.passed and r.passed
    report.mode = "layer-streamed"
    report.matmul_tflop = cost.flop * 2 / 1e12
    report.matmul_gflops = cost.gflops
    report.floor_s = cost.floor_s
    report.ranks = cost.ranks
    report.layers = [asdict(d) for d in layers]
    first = next((d.layer for d in layers if d.diverges), None)
    report.first_divergent_layer = first
    if first is not None:
        report.passed = False
    return report


def _unobserved(reference, prompts, hf, probe, atol, rtol, family, ctx, whole_model) -> list:
    """The mapped features the gate's prompts could not see, and what --whole-model leaves out."""
    sight = Sight(reference, [p.shape[1] for p in prompts], hf, probe, atol, rtol)
    unobserved = unobserved_features(sight, mapped_fields(family))
    if whole_model and ctx.mtp_layers:
        unobserved.append(
            {
                "field": "mtp_num_layers",
                "value": ctx.mtp_layers,
                "why": f"the {ctx.mtp_layers} multi-token-prediction layer(s): --whole-model "
                "compares the main logits only (the layer-streamed gate compares theirs too)",
            }
        )
    return unobserved


def _verify_in_child(hf_dir, ckpt, device: str, given: dict) -> ParityReport:
    """:func:`verify` in a process of its own on ``device`` (``porting verify --json``), with
    this call's tolerances and options (``given``: its arguments); the child's report.

    For a device this process cannot use: the GPUs it hid for a conversion (the child is started
    with them visible), or the CPU after the device ran out of memory (the child starts with none,
    so Megatron builds as on a CPU node).
    """
    import json
    import os
    import subprocess

    from porting import cpu
    from porting.convert.checkpoint import adopted
    from porting.errors import PortingError

    cmd = [sys.executable, "-m", "porting.cli", "verify", str(hf_dir), str(ckpt), "--json"]
    cmd += ["--device", device, "--atol", repr(given["atol"]), "--rtol", repr(given["rtol"])]
    cmd += ["--min-top1", repr(given["min_top1"])]
    cmd += ["--whole-model"] * bool(given["whole_model"])
    cmd += ["--allow-pickle"] * bool(given["allow_pickle"])
    stand_in = adopted(ckpt)
    if stand_in is not None:  # a checkpoint trained elsewhere, as this process reads it
        cmd += ["--hf-config", str(stand_in.hf_config)]
        cmd += ["--tokenizer", str(stand_in.tokenizer_dir)] * bool(stand_in.tokenizer_dir)
    env = cpu.environment_with_gpus() if device != "cpu" else dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if given["scratch_dir"] is not None:  # the hidden states wait beside the partial output
        env["TMPDIR"] = str(given["scratch_dir"])
    # stderr passes through: the progress bar, and a device's fallback line
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    if proc.returncode not in (0, 1):
        raise PortingError(
            f"the parity gate on {device} failed (exit {proc.returncode}, its error above); "
            + ("--device cpu runs it on the CPU" if device != "cpu" else "nothing was written")
        )
    try:
        data = json.loads(proc.stdout)
    except ValueError as err:
        raise PortingError(f"the parity gate on {device} printed no report ({err})") from err
    known = {f.name for f in fields(ParityReport)}
    report = ParityReport(**{k: v for k, v in data.items() if k in known})
    for name in ("max_abs_diff", "mean_abs_diff", "kl_hf_mcore", "worst_excess"):
        if getattr(report, name) is None:  # strict JSON wrote a non-finite value as null
            setattr(report, name, math.nan)
    return report
