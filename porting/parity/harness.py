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

import torch

from porting.parity.streamed import LAYER_RTOL

log = logging.getLogger(__name__)

PROMPT_TEXTS = (
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "東京は日本の首都です。Megatron and NeMo train large language models across many GPUs, "
    "while Hugging Face transformers is where most checkpoints are shared and evaluated.",
)
RANDOM_PROMPT_LEN = 64
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
    # and its floor, both sides' matmuls at this device's measured fp32 rate (layer-streamed).
    device: str = "cpu"
    wall_s: float | None = None
    floor_s: float | None = None
    floor_ratio: float | None = None
    matmul_tflop: float | None = None
    matmul_gflops: float | None = None

    def as_dict(self) -> dict:
        """JSON-ready dict: strict JSON, a non-finite number (NaN, Inf) becomes ``null`` (the
        ``nonfinite_*`` counts say why)."""
        return _finite(asdict(self))

    def summary(self) -> str:
        """Human-readable one-block summary."""
        verdict = "PASS" if self.passed else "FAIL"
        text = (
            f"parity {verdict}: {self.prompts} prompts, {self.positions} positions, "
            f"vocab {self.vocab_size}\n"
        )
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
            worst = max(self.layers, key=lambda d: d["own_max_rel"])
            text += (
                f"\n  layers         {len(self.layers)} streamed; largest own error at layer "
                f"{worst['layer']}: {worst['own_max_rel']:.1e} relative"
            )
        if self.wall_s is not None:
            text += f"\n  gate           {self.wall_s:.1f} s on {self.device}"
            if self.floor_s:
                text += (
                    f"; floor {self.floor_s:.1f} s ({self.matmul_tflop:.2f} TFLOP of matmul at "
                    f"{self.matmul_gflops:.0f} GFLOP/s): {self.floor_ratio:.1f}x"
                )
        if self.first_divergent_layer is not None:
            d = self.layers[self.first_divergent_layer]
            text += (
                f"\n  first divergence at layer {d['layer']}: max |d hidden| "
                f"{d['own_max_abs']:.1e} ({d['own_max_rel']:.1e} relative, on the HF layer's "
                f"input; fp32 explains up to {LAYER_RTOL:g})"
            )
        return text


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def build_prompts(tokenizer, vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    """The fixed prompts as ``[1, seq]`` id tensors (text prompts plus one random-id prompt)."""
    prompts = []
    for text in PROMPT_TEXTS:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"] if tokenizer else []
        if ids:
            prompts.append(torch.tensor([ids], dtype=torch.long))
    g = torch.Generator().manual_seed(seed)
    prompts.append(torch.randint(0, vocab_size, (1, RANDOM_PROMPT_LEN), generator=g))
    return prompts


def compare(
    hf: list[torch.Tensor],
    mc: list[torch.Tensor],
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    min_top1: float = DEFAULT_MIN_TOP1,
) -> ParityReport:
    """Compare per-prompt logits ``[1, seq, vocab]`` (Megatron's already cut to the HF vocabulary)."""
    a = torch.cat([t.reshape(-1, t.shape[-1]) for t in hf]).double()
    b = torch.cat([t.reshape(-1, t.shape[-1]) for t in mc]).double()
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: HF {tuple(a.shape)} vs Megatron {tuple(b.shape)}")
    diff = (a - b).abs()
    excess = (diff - (atol + rtol * b.abs())).max().item()
    logp = torch.log_softmax(a, -1)
    logq = torch.log_softmax(b, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    bad_a, bad_b = ~torch.isfinite(a), ~torch.isfinite(b)
    # argmax takes NaN for the largest value: two all-NaN rows would "agree" at index 0. Only
    # positions finite on both sides can agree.
    rows = ~(bad_a.any(-1) | bad_b.any(-1))
    top1 = ((a.argmax(-1) == b.argmax(-1)) & rows).double().mean().item()
    finite = not (bad_a.any() or bad_b.any())
    return ParityReport(
        prompts=len(hf),
        positions=a.shape[0],
        vocab_size=a.shape[1],
        max_abs_diff=diff.max().item(),
        mean_abs_diff=diff.mean().item(),
        kl_hf_mcore=kl,
        top1_agreement=top1,
        atol=atol,
        rtol=rtol,
        min_top1=min_top1,
        worst_excess=excess,
        passed=finite and excess <= 0 and top1 >= min_top1,
        nonfinite_hf=int(bad_a.sum()),
        nonfinite_megatron=int(bad_b.sum()),
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

    cls = (
        getattr(transformers, hf_model_class) if isinstance(hf_model_class, str) else hf_model_class
    )
    model = cls.from_pretrained(
        str(hf_dir),
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
    )
    model.to(device).eval()
    out = [model(p.to(device)).logits.float().cpu() for p in prompts]
    del model
    gc.collect()
    return out


def megatron_logits_from_checkpoint(
    ckpt: str | Path,
    prompts: list[torch.Tensor],
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Logits of the Megatron model loaded from ``ckpt`` (cast to ``dtype``, fp32 by default), cut
    to the HF vocabulary. The model lives where Megatron builds it: the GPU when CUDA is visible."""
    from porting.convert.checkpoint import read_manifest
    from porting.convert.megatron import init_parallel, load_mcore_from_checkpoint, mcore_logits
    from porting.registry import family_by_name

    family = family_by_name(read_manifest(ckpt).family)
    init_parallel()
    model, _ = load_mcore_from_checkpoint(ckpt, family, dtype=dtype)
    out = [mcore_logits(model, p)[..., :vocab_size] for p in prompts]
    del model
    gc.collect()
    return out


def verify(
    hf_dir: str | Path,
    ckpt: str | Path,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    min_top1: float = DEFAULT_MIN_TOP1,
    whole_model: bool = False,
    show_progress: bool = False,
    allow_pickle: bool = False,
    scratch_dir: str | Path | None = None,
    device: str = "cpu",
) -> ParityReport:
    """Run the parity check of an HF directory against one of our NeMo checkpoints.

    By default layer-streamed (:mod:`porting.parity.streamed`): two decoder layers of one side in
    memory at a time, per-layer divergence reported and the first diverging layer named. With
    ``whole_model`` both models are loaded whole (never together: Megatron first, then HF).
    ``scratch_dir``: see :func:`porting.parity.streamed.streamed_logits`. ``device``: ``cpu``,
    or ``cuda`` for the layers streamed to the device (in a child process when this one has hidden
    its GPUs for a conversion); a device that runs out of memory hands the gate to the CPU, with
    one line on stderr, and the verdict is the CPU's.
    """

    from porting.convert.checkpoint import read_manifest, tokenizer_files
    from porting.convert.config_map import load_tokenizer, read_hf_config
    from porting.convert.layouts import check_saved_metadata
    from porting.convert.megatron import build_config
    from porting.convert.preflight import check_float_dtypes, check_hf_checkpoint
    from porting.convert.safetensors_io import SafetensorsSource
    from porting.registry import family_by_name

    if torch.device(device).type != "cpu":
        from porting import cpu

        if not cpu.cuda_available():  # hidden from this process for the conversion
            return _verify_in_child(hf_dir, ckpt, device, locals())
    manifest = read_manifest(ckpt)
    family = family_by_name(manifest.family)  # imports NeMo: start-up, not the gate
    started = time.perf_counter()
    # Not read here, but a checkpoint whose metadata would run code on load is hostile.
    check_saved_metadata(ckpt, family)
    # The HF side's config against its headers before either model is built (the Megatron
    # side's is checked as its config is rebuilt, checkpoint_config).
    hf_config = read_hf_config(hf_dir)
    source = SafetensorsSource(hf_dir, allow_pickle=allow_pickle)
    check_float_dtypes(family, source)
    _, ctx = build_config(family, hf_config, torch.float32, vocab_divisor=1)
    check_hf_checkpoint(family, hf_config, ctx, source, Path(hf_dir) / "config.json", "verify")
    tok_files = tokenizer_files(ckpt, manifest)
    tokenizer = load_tokenizer(tok_files[0].parent) if tok_files else None
    prompts = build_prompts(tokenizer, manifest.vocab_size)
    if whole_model:
        mc = megatron_logits_from_checkpoint(ckpt, prompts, manifest.vocab_size)
        hf_cls = family.hf_class(manifest.hf_architecture)
        hf = hf_logits(hf_dir, hf_cls, prompts, family.hf_attn_implementation, device=device)
        report = compare(hf, mc, atol=atol, rtol=rtol, min_top1=min_top1)
    else:
        from porting.convert.megatron import init_parallel
        from porting.parity.streamed import streamed_logits

        init_parallel()
        try:
            hf, mc, layers, cost = streamed_logits(
                hf_dir,
                ckpt,
                family,
                prompts,
                manifest.vocab_size,
                show_progress,
                allow_pickle,
                scratch_dir,
                device,
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
        report = compare(hf, mc, atol=atol, rtol=rtol, min_top1=min_top1)
        report.mode = "layer-streamed"
        report.matmul_tflop = cost.flop * 2 / 1e12
        report.matmul_gflops = cost.gflops
        report.floor_s = cost.floor_s
        report.layers = [asdict(d) for d in layers]
        first = next((d.layer for d in layers if d.diverges), None)
        report.first_divergent_layer = first
        if first is not None:
            report.passed = False
    report.device = torch.device(device).type
    report.wall_s = time.perf_counter() - started
    if report.floor_s:
        report.floor_ratio = report.wall_s / report.floor_s
    log.debug("%s", report.summary())
    return report


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
