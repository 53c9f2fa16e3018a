"""The ``quantization_config`` a checkpoint may carry, read without torch: which storage of the
weights it names (FP8 e4m3 in blocks, MXFP4), refused by name when it is one porting does not
read. The engine's :mod:`porting.convert.quant` dequantizes what this admits; the config lint
(:mod:`porting.contract.config_map`) calls :func:`read_quantization` before any tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from porting.errors import PortingError

FP8 = "fp8"
MXFP4 = "mxfp4"

_FP8_KEYS = {
    "quant_method",
    "fmt",
    "activation_scheme",
    "weight_block_size",
    "modules_to_not_convert",
    "scale_fmt",
}
# The scale formats read: "ue8m0" (DeepSeek-V3.1's releases) tags scales that are powers of two,
# stored as float32 all the same; a weight is its FP8 codes times its block's scale either way, so
# reading it changes nothing, and an export asked for FP8 writes powers of two again.
UE8M0 = "ue8m0"
_MXFP4_KEYS = {"quant_method", "modules_to_not_convert"}


@dataclass(frozen=True)
class Quantization:
    """A ``quantization_config`` we read: the method and, for FP8, its block size."""

    method: str
    block: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None  # UE8M0: every scale a power of two


def read_quantization(hf_config: dict, where: str) -> Quantization | None:
    """``hf_config``'s ``quantization_config``, or ``None`` without one; anything we do not read
    is refused naming the field and its value."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    name = "quantization_config"
    if not isinstance(qc, dict):
        raise PortingError(f"{where}: {name} must be an object, not {qc!r}"[:300])
    method = qc.get("quant_method")
    if method not in (FP8, MXFP4):
        raise PortingError(
            f"{where}: {name}.quant_method={method!r} is not read by porting (it reads fp8, "
            "block-scaled e4m3, and mxfp4); its tensors are not weights that could be cast"
        )
    known = _FP8_KEYS if method == FP8 else _MXFP4_KEYS
    unknown = sorted(set(qc) - known)
    if unknown:
        raise PortingError(
            f"{where}: {name}.{unknown[0]}={qc[unknown[0]]!r} is not read by porting for "
            f"quant_method {method!r} (it reads {', '.join(sorted(known))})"[:400]
        )
    skip = qc.get("modules_to_not_convert")
    if skip is not None and not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise PortingError(
            f"{where}: {name}.modules_to_not_convert={skip!r} must be a list of names"
        )
    if method == MXFP4:
        return Quantization(MXFP4)
    if qc.get("fmt", "e4m3") != "e4m3":
        raise PortingError(f"{where}: {name}.fmt={qc['fmt']!r} is not read (only e4m3)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise PortingError(
            f"{where}: {name}.activation_scheme={qc['activation_scheme']!r} is not read (only "
            "dynamic: a static scheme ships activation scales the Megatron model has no place for)"
        )
    block = qc.get("weight_block_size", [128, 128])
    if block != [128, 128] or not all(type(b) is int for b in block):
        # every published FP8 release uses 128x128, the only size the tests prove
        raise PortingError(
            f"{where}: {name}.weight_block_size={block!r} is not read (only [128, 128])"
        )
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, UE8M0):
        raise PortingError(
            f"{where}: {name}.scale_fmt={scale_fmt!r} is not read (only {UE8M0!r}, scales that are "
            "powers of two stored as floats)"[:300]
        )
    return Quantization(FP8, tuple(block), scale_fmt)
