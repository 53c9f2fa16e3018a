"""Quantized HF checkpoints: the formats that ship, read as their unquantized weights.

Two weight formats are read, both named by ``config.json``'s ``quantization_config``:

- ``fp8`` (DeepSeek-V3, Kimi-K2, the FP8 Qwen3 releases): a Linear's ``weight`` stored as
  ``float8_e4m3fn`` next to a float32 ``weight_scale_inv`` with one value per
  ``weight_block_size`` block (128 x 128), edge blocks clipped to the matrix. The weight is
  ``fp32(w) * scale_inv`` of its block, rounded once to the compute dtype (DeepSeek's
  ``weight_dequant``);
- ``mxfp4`` (gpt-oss): ``X_blocks`` (uint8, two E2M1 values a byte, low nibble first, 32 values a
  block) and ``X_scales`` (uint8 power-of-two exponents, bias 127) stand for ``X``, in the layout
  transformers' ``convert_moe_packed_tensors`` reads: blocks ``[E, R, G, 16]`` give ``X`` of
  ``[E, G * 32, R]`` (its experts' ``gate_up_proj`` keeps its gate/up interleave).

:class:`QuantizedView` plans, from the safetensors headers alone, which stored tensors stand for
which weight (name, dequantized shape, compute dtype), refusing a scale that is missing, of the
wrong shape or dtype, and FP8 weights without a ``quantization_config``, then reads every scale
and refuses a non-finite one: all before any tensor is converted. Any other ``quant_method``
(GPTQ, AWQ, bitsandbytes, compressed-tensors, ...) is refused by name: its tensors are not weights
we could cast.

Dequantization is one tensor at a time, in block rows: besides the mapped input, the output is the
one full-size tensor made.
The parity gate reads the same tensors through its own dequantizer (transformers' where it has one,
:mod:`porting.parity.hf_dequant`), so that ours is checked, not repeated.

Export writes bf16 by default; :func:`quantize_fp8_block` makes FP8 blocks and their scales for
``porting export --quantize fp8-block``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from porting.contract.quantization import FP8, MXFP4, Quantization
from porting.convert import packed_experts
from porting.errors import PortingError

if TYPE_CHECKING:  # torch is imported where tensors are made: config.json is refused without it
    import torch

SCALE_DTYPES = ("F32", "BF16", "F16")
SCALE_SUFFIX = "_scale_inv"  # DeepSeek's name: the scale that multiplies the stored value
BLOCKS, SCALES = "_blocks", "_scales"
MXFP4_BLOCK = 32  # E2M1 values per shared exponent (OCP MX)
MXFP4_BIAS = 127
MXFP4_NAN = 255  # E8M0's one non-finite code
FP8_MAX = 448.0  # largest finite float8_e4m3fn

_COMPUTE = ("bfloat16", "float16", "float32")
# safetensors float dtype names as torch names
FLOAT_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def compute_dtype(hf_config: dict, where: str) -> torch.dtype:
    """The dtype a quantized checkpoint's weights are dequantized to: its ``torch_dtype`` (bf16
    where it names none, as transformers' MXFP4 loader and DeepSeek's own cast do)."""
    name = hf_config.get("torch_dtype", hf_config.get("dtype")) or "bfloat16"
    if name not in _COMPUTE:
        raise PortingError(
            f"{where}: torch_dtype={name!r}: a quantized checkpoint dequantizes to one of "
            f"{', '.join(_COMPUTE)}"
        )
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class Dequantizer:
    """How the stored parts become a weight: ``parts(kind, name)`` names the two stored tensors
    weight ``name`` is made from, ``fp8_block(weight, scale_inv, block, dtype)`` and
    ``mxfp4(blocks, scales, dtype)`` make it. The importer uses :data:`OURS`; the gate its own,
    pairing and arithmetic both, so that an error in either is not on both sides."""

    name: str
    fp8_block: Callable[[torch.Tensor, torch.Tensor, tuple[int, int], torch.dtype], torch.Tensor]
    mxfp4: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    parts: Callable[[str, str], tuple[str, str]]


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``weight`` (``float8_e4m3fn``, ``[..., rows, cols]``) times its block's ``scale_inv``
    (float32, ``[..., ceil(rows / bm), ceil(cols / bn)]``), in float32, rounded once to ``dtype``.

    One block row at a time: besides the output, only one block row's float32 product exists.
    """
    import torch

    bm, bn = block
    rows, cols = weight.shape[-2:]
    lead = weight.shape[:-2]
    w = weight.reshape(-1, rows, cols)
    s = scale_inv.reshape(-1, *scale_inv.shape[-2:]).to(torch.float32)
    out = torch.empty(w.shape, dtype=dtype)
    for m in range(w.shape[0]):
        for i, r0 in enumerate(range(0, rows, bm)):
            r1 = min(r0 + bm, rows)
            col_scale = s[m, i].repeat_interleave(bn)[:cols]  # one value per column of the row
            out[m, r0:r1] = (w[m, r0:r1].to(torch.float32) * col_scale).to(dtype)
    return out.reshape(*lead, rows, cols)


def _e2m1_values() -> torch.Tensor:
    """The 16 E2M1 codes as float32: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    import torch

    codes = torch.arange(16)
    sign = torch.where(codes & 8 > 0, -1.0, 1.0)
    exp, man = (codes >> 1) & 3, (codes & 1).to(torch.float32)
    mag = torch.where(exp == 0, man * 0.5, (1 + man / 2) * torch.exp2((exp - 1).to(torch.float32)))
    return sign * mag  # code 8 is -0.0: the sign survives the product


def _power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8, bias 127) as exact float32 powers of two, built from their bits:
    ``2**(s - 127)`` is float32's bit pattern ``s << 23``, and ``2**-127`` its one subnormal."""
    import torch

    bits = scales.to(torch.int32) << 23
    bits = torch.where(scales == 0, torch.tensor(1 << 22, dtype=torch.int32), bits)
    return bits.view(torch.float32)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """MXFP4 ``blocks`` ``[E, R, G, 16]`` and ``scales`` ``[E, R, G]`` as ``[E, G * 32, R]`` in
    ``dtype`` (transformers' layout for gpt-oss experts), one expert at a time."""
    import torch

    values = _e2m1_values()
    n, rows, groups, width = blocks.shape
    out = torch.empty(n, groups * width * 2, rows, dtype=dtype)
    for e in range(n):
        b = blocks[e].to(torch.int64)
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(rows, groups, width * 2)
        scaled = values[codes] * _power_of_two(scales[e]).unsqueeze(-1)
        out[e] = scaled.reshape(rows, groups * width * 2).to(dtype).transpose(0, 1)
    return out


def parts_of(kind: str, name: str) -> tuple[str, str]:
    """The stored tensors weight ``name`` is made from: FP8 ``(name, name + "_scale_inv")``,
    MXFP4 ``(name + "_blocks", name + "_scales")``."""
    return (name, name + SCALE_SUFFIX) if kind == FP8 else (name + BLOCKS, name + SCALES)


OURS = Dequantizer("porting", dequantize_fp8_block, dequantize_mxfp4, parts_of)


@dataclass(frozen=True)
class Planned:
    """One weight a quantized checkpoint stands for: the stored parts it is made from."""

    kind: str  # FP8 or MXFP4
    parts: tuple[str, str]  # (weight or blocks, scale)
    shape: tuple[int, ...]


class QuantizedView:
    """Which stored tensors of a checkpoint make which weights, from the headers alone.

    ``stored``: key -> (safetensors dtype, shape, file) of every stored tensor. :attr:`planned`
    maps each dequantized weight's name to its parts; every other stored tensor is itself.
    """

    def __init__(
        self,
        stored: dict[str, tuple[str, tuple[int, ...], object]],
        quant: Quantization | None,
        dtype: torch.dtype,
        where: str,
    ) -> None:
        self.quant, self.dtype = quant, dtype
        self.planned: dict[str, Planned] = {}
        self.parts: set[str] = set()
        fp8 = sorted(k for k, (dt, _, _) in stored.items() if dt.startswith("F8_"))
        if quant is None:
            if fp8:
                dt, _, f = stored[fp8[0]]
                raise PortingError(
                    f"{f}: tensor {fp8[0]!r} is stored as {dt}, but {where} has no "
                    "quantization_config saying how to read it"
                )
            return
        if quant.method == FP8:
            self._plan_fp8(stored, fp8, quant.block)
        else:
            self._plan_mxfp4(stored)
        self.parts = {p for plan in self.planned.values() for p in plan.parts}

    def _plan_fp8(self, stored, fp8: list[str], block: tuple[int, int]) -> None:
        for key in fp8:
            dt, shape, f = stored[key]
            if dt != "F8_E4M3":
                raise PortingError(f"{f}: tensor {key!r} is {dt}; quant_method fp8 reads F8_E4M3")
            scale = key + SCALE_SUFFIX
            if scale not in stored:
                raise PortingError(f"{f}: FP8 tensor {key!r} has no scale {scale!r}")
            if len(shape) < 2:
                raise PortingError(f"{f}: FP8 tensor {key!r} of shape {shape} is not a matrix")
            want = (
                *shape[:-2],
                *(math.ceil(d / b) for d, b in zip(shape[-2:], block, strict=True)),
            )
            sdt, sshape, sf = stored[scale]
            # DeepSeek-V3 ships float32 scales, the FP8 Qwen3 releases bf16 (some f16): all widen
            # to float32 exactly
            if sdt not in SCALE_DTYPES or tuple(sshape) != want:
                raise PortingError(
                    f"{sf}: scale {scale!r} is {sdt} {tuple(sshape)}; FP8 tensor {key!r} of shape "
                    f"{shape} in {block[0]}x{block[1]} blocks needs {want} in "
                    f"{'/'.join(SCALE_DTYPES)}"
                )
            self.planned[key] = Planned(FP8, (key, scale), tuple(shape))
        for key, (_, _, f) in stored.items():
            if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) not in self.planned:
                raise PortingError(f"{f}: scale {key!r} belongs to no FP8 tensor")

    def _plan_mxfp4(self, stored) -> None:
        for key, (dt, shape, f) in stored.items():
            if key.endswith(SCALES) and key.removesuffix(SCALES) + BLOCKS not in stored:
                raise PortingError(f"{f}: scales {key!r} belong to no {BLOCKS} tensor")
            if not key.endswith(BLOCKS):
                continue
            name = key.removesuffix(BLOCKS)
            scale = name + SCALES
            if scale not in stored:
                raise PortingError(f"{f}: MXFP4 tensor {key!r} has no scales {scale!r}")
            if dt != "U8" or len(shape) != 4 or shape[-1] != MXFP4_BLOCK // 2:
                raise PortingError(
                    f"{f}: MXFP4 tensor {key!r} is {dt} {tuple(shape)}; it must be U8 "
                    f"[experts, rows, groups, {MXFP4_BLOCK // 2}]"
                )
            sdt, sshape, sf = stored[scale]
            if sdt != "U8" or tuple(sshape) != tuple(shape[:-1]):
                raise PortingError(
                    f"{sf}: scales {scale!r} are {sdt} {tuple(sshape)}; MXFP4 tensor {key!r} of "
                    f"shape {tuple(shape)} needs U8 {tuple(shape[:-1])}"
                )
            if name in stored:
                raise PortingError(f"{f}: {name!r} is stored both plain and as {key!r}")
            n, rows, groups, _ = shape
            self.planned[name] = Planned(MXFP4, (key, scale), (n, groups * MXFP4_BLOCK, rows))

    def keys(self, stored_keys: list[str]) -> list[str]:
        """The checkpoint's weights by name: each planned one once, in place of its parts."""
        if not self.planned:
            return list(stored_keys)
        out, seen = [], set()
        by_part = {p: name for name, plan in self.planned.items() for p in plan.parts}
        for key in stored_keys:
            name = by_part.get(key, key)
            if name not in seen:
                seen.add(name)
                out.append(name)
        return out

    def dequantize(
        self, name: str, read: Callable[[str], torch.Tensor], dq: Dequantizer, where: str
    ) -> torch.Tensor:
        """Weight ``name`` made by ``dq`` from the parts it pairs it with (``read(key)``: a stored
        tensor)."""
        plan = self.planned[name]
        keys = dq.parts(plan.kind, name)
        if not set(keys) <= self.parts:
            raise PortingError(f"{where}: {dq.name} reads {name!r} from {keys}, not stored parts")
        data, scale = (read(p) for p in keys)
        if plan.kind == FP8:
            return dq.fp8_block(data, scale, self.quant.block, self.dtype)
        return dq.mxfp4(data, scale, self.dtype)

    def check_scales(self, view: Callable[[str], object], where: Callable[[str], str]) -> None:
        """Refuse a non-finite scale (FP8: NaN or Inf; MXFP4: E8M0's NaN code) naming its tensor.

        Before any tensor is converted: the scales are a small part of the checkpoint (1/16384 of
        an FP8 weight's bytes, 1/16 of MXFP4's), read through ``view(key)``, a context giving the
        stored tensor as a view of its file."""
        import torch

        for plan in self.planned.values():
            key = plan.parts[1]
            with view(key) as scale:
                if plan.kind == FP8:
                    bad = scale.numel() - int(torch.isfinite(scale).sum())
                    what = "non-finite value(s)"
                else:
                    bad = int((scale == MXFP4_NAN).sum())
                    what = f"NaN exponent(s) (E8M0 code {MXFP4_NAN})"
            if bad:
                raise PortingError(f"{where(key)}: scale tensor {key!r} holds {bad} {what}")


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[rows, cols]`` as ``float8_e4m3fn`` and its float32 ``weight_scale_inv``:
    each block's largest magnitude maps to 448 (an all-zero block gets scale 1), one block row at a
    time. The inverse of :func:`dequantize_fp8_block` up to FP8's rounding.

    ``power_of_two`` (``scale_fmt: ue8m0``): each scale is rounded up to a power of two, as
    DeepSeek's quantizer does; a weight dequantized from such a release then quantizes back to
    the same codes and scales, bit for bit (its largest code lies in (224, 448], so the scale
    found is the one it was made with, and code x power of two is exact in bf16)."""
    import torch

    bm, bn = block
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    nb = math.ceil(cols / bn)
    scales = torch.empty(math.ceil(rows / bm), nb, dtype=torch.float32)
    for i, r0 in enumerate(range(0, rows, bm)):
        r1 = min(r0 + bm, rows)
        w = weight[r0:r1].to(torch.float32)
        padded = torch.nn.functional.pad(w.abs(), (0, nb * bn - cols))
        amax = padded.reshape(r1 - r0, nb, bn).amax(dim=(0, 2))
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        if power_of_two:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        scales[i] = s
        q[r0:r1] = (w / s.repeat_interleave(bn)[:cols]).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
    return q, scales


def fp8_config(block: tuple[int, int] = (128, 128), skip: list[str] | None = None) -> dict:
    """The ``quantization_config`` of an FP8-block export, as the FP8 releases write it."""
    qc = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": FP8,
        "weight_block_size": list(block),
    }
    if skip:
        qc["modules_to_not_convert"] = skip
    return qc


def fp8_targets(hf_class, hf_config: dict, keys: Iterable[str] = ()) -> set[str]:
    """The weight names transformers' FP8 loader expects in FP8: every ``nn.Linear`` of the model
    (built on the meta device from ``hf_config``) but ``lm_head`` and ``modules_to_not_convert``
    (``replace_with_fp8_linear``'s rule: a module whose dotted name contains one is skipped).

    Of ``keys`` (a checkpoint's), those of a layer past ``num_hidden_layers`` (a
    multi-token-prediction layer, DeepSeek-V3's ``model.layers.61``), which no class builds, are
    FP8 where the last decoder layer's same weight is: the layer is a decoder layer, and its own
    projections (``eh_proj``) stay as they are, as vLLM's DeepSeek MTP reads them."""
    import torch
    from accelerate import init_empty_weights

    fields = {k: v for k, v in hf_config.items() if k not in ("quantization_config", "auto_map")}
    config = hf_class.config_class(**fields)
    with init_empty_weights():
        model = hf_class._from_config(config)
    skip = [
        "lm_head",
        *((hf_config.get("quantization_config") or {}).get("modules_to_not_convert") or []),
    ]
    targets = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not any(s in name for s in skip)
    }
    # transformers 5 computes a layer's experts from two stacked parameters, no nn.Linear each,
    # and some routers in a module of their own, but a release stores the experts one weight
    # each under the published names, FP8 as the Linears transformers 4 built for them were
    # (without this, every routed expert of an export on the current stack stayed unquantized)
    model_type = config.model_type
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    where = f"transformers' {hf_class.__name__}"
    published = packed_experts.plan(model_type, shapes, where)
    renamed = {src: name for name, src in published.items() if isinstance(src, str)}
    targets |= {
        name
        for name, src in published.items()
        if isinstance(src, packed_experts.Slice) and not any(s in name for s in skip)
    }
    for name in shapes:
        linear = name in targets or (
            model_type in _LINEAR_ROUTERS_IN_4X and _ROUTER_KEY.match(name) is not None
        )
        if name in renamed or (linear and name not in targets):
            targets.discard(name)
            if linear and not any(s in renamed.get(name, name) for s in skip):
                targets.add(renamed.get(name, name))
    last = hf_config.get("num_hidden_layers")
    for key in keys:
        m = _LAYER_KEY.match(key)
        if m and isinstance(last, int) and int(m[2]) >= last:
            if f"{m[1]}{last - 1}.{m[3]}" in targets:
                targets.add(key)
    return targets


# The model types whose router transformers 4.57 built as an nn.Linear (``self.gate =
# nn.Linear(hidden, experts)`` in modeling_{mixtral,qwen2_moe,qwen3_moe,olmoe}.py) and
# transformers 5 as a router module of its own: FP8 where transformers 4's loader made it so.
# DeepSeek-V3's was a module of its own in both.
_LINEAR_ROUTERS_IN_4X = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}
_ROUTER_KEY = re.compile(r".*\.layers\.\d+\.mlp\.gate\.weight\Z")


_LAYER_KEY = re.compile(r"(.*\.layers\.)(\d+)\.(.+)\Z")
