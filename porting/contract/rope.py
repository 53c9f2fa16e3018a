"""A config's ``rope_scaling`` as transformers validates it, for any family's config entries:
which scaling it names (and whether Megatron-Core's rotary embedding can compute it), and each
number it carries, refused by name where transformers would refuse or silently drop it."""

from __future__ import annotations

import math

from porting.errors import PortingError

# The keys each rotary type reads besides rope_type / type: transformers 4.57's
# modeling_rope_utils._validate_<type>_parameters (required and optional together). Any other key
# is refused by name: transformers only warns, and a misspelt one would be dropped silently.
ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}
# The types transformers knows that Megatron-Core's rotary embedding cannot compute, and why: it
# computes one frequency table per model (RotaryEmbedding.inv_freq), the same for every length.
# Up to max_position_embeddings dynamic NTK is the unscaled table: the gate's prompts could not tell.
ROPE_REFUSED = {
    "dynamic": (
        "dynamic NTK recomputes the frequencies from the running sequence length once it passes "
        "max_position_embeddings, and Megatron-Core's rotary embedding computes one frequency "
        "table for every length"
    ),
    "longrope": (
        "LongRoPE switches between per-dimension short_factor and long_factor tables by sequence "
        "length, and Megatron-Core's rotary embedding has one frequency table for every length"
    ),
}


def rope_number(
    rs: dict,
    key: str,
    *,
    at_least: float | None = None,
    above: float | None = None,
    integer: bool = False,
):
    """``rope_scaling[key]`` as transformers' ``rope_config_validation`` requires it (present, a
    finite number, an integer where it must be, ``factor >= 1``), or one line naming it: a factor
    of 0 divided by zero inside Megatron's rotary embedding, a negative one converted silently."""
    v = rs.get(key)
    ok = (
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and (not integer or isinstance(v, int))
        and (at_least is None or v >= at_least)
        and (above is None or v > above)
    )
    if not ok:
        kind = "an integer" if integer else "a finite number"
        bound = f" >= {at_least:g}" if at_least is not None else ""
        bound += f" > {above:g}" if above is not None else ""
        raise PortingError(f"config.json: rope_scaling.{key} must be {kind}{bound}, not {v!r}")
    return v


def rope_kind(rs: dict) -> str:
    """The rotary type ``rs`` names. transformers' configs write the legacy ``type`` and the newer
    ``rope_type`` both; they must agree, since its config classes copy ``type`` over
    ``rope_type`` while its rotary validation reads ``rope_type`` first."""
    if "type" in rs and "rope_type" in rs and rs["type"] != rs["rope_type"]:
        raise PortingError(
            f"config.json: rope_scaling.type ({rs['type']!r}) and rope_scaling.rope_type "
            f"({rs['rope_type']!r}) disagree"
        )
    kind = rs.get("rope_type", rs.get("type"))
    if not isinstance(kind, str):
        raise PortingError(
            f"config.json: rope_scaling.rope_type (or type) must name the scaling, not {kind!r}"
        )
    if kind in ROPE_REFUSED:
        raise PortingError(
            f"config.json: rope_scaling type {kind!r} is not supported: {ROPE_REFUSED[kind]}"
        )
    if kind not in ROPE_KEYS:
        raise PortingError(
            f"config.json: rope_scaling type {kind!r} is not supported: Megatron-Core's rotary "
            f"embedding has no such scaling (supported: {', '.join(map(repr, ROPE_KEYS))})"
        )
    extra = sorted(set(rs) - {"rope_type", "type"} - ROPE_KEYS[kind])
    if extra:
        reads = ", ".join(sorted(ROPE_KEYS[kind])) or "nothing else"
        raise PortingError(
            f"config.json: rope_scaling key(s) {', '.join(map(repr, extra))} are not read by "
            f"{kind!r} scaling (transformers reads {reads}); refused rather than dropped"
        )
    return kind
