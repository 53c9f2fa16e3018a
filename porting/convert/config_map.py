"""Declarative mapping of HF ``config.json`` fields onto a family's Megatron config, with a lint.

A family lists every HF field it knows, in one of four kinds:

- :class:`Field`   - one HF field is one Megatron field (optionally converted both ways);
- :class:`Derived` - several HF fields together set Megatron fields (biases, rope scaling);
- :class:`Require` - a field whose value must satisfy a check, else the maths would change in a way
  we cannot represent; the error names the field and the value;
- :class:`Carry`   - a field that does not change the maths (ids, bookkeeping); it is stored in the
  checkpoint and written back unchanged on export.

Any HF field the family does not list is an error: an unknown field might change the maths, and we
never drop one silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from porting.errors import PortingError

_MISSING = object()


def _same(v: Any) -> Any:
    return v


@dataclass(frozen=True)
class Field:
    """HF field ``hf`` <-> Megatron field ``mcore``; ``default`` applies when ``hf`` is absent."""

    hf: str
    mcore: str
    to_mcore: Callable[[Any], Any] = _same
    to_hf: Callable[[Any], Any] = _same
    default: Any = _MISSING


@dataclass(frozen=True)
class Derived:
    """HF fields ``hf`` jointly set Megatron fields.

    ``to_mcore(hf_config) -> dict`` of Megatron fields (raise PortingError for unsupported values);
    ``to_hf(mcore_config) -> dict`` of HF fields for export.
    """

    hf: tuple[str, ...]
    to_mcore: Callable[[dict], dict]
    to_hf: Callable[[Any], dict]


@dataclass(frozen=True)
class Require:
    """HF field ``hf`` must satisfy ``ok(value)`` when present; ``why`` explains the constraint."""

    hf: str
    ok: Callable[[Any], bool]
    why: str


@dataclass(frozen=True)
class Carry:
    """HF field ``hf`` does not change the maths; it is carried through export unchanged."""

    hf: str


ConfigEntry = Field | Derived | Require | Carry


def _names(entry: ConfigEntry) -> tuple[str, ...]:
    return entry.hf if isinstance(entry, Derived) else (entry.hf,)


def known_fields(entries: Iterable[ConfigEntry]) -> set[str]:
    """Every HF field name the family accounts for."""
    return {n for e in entries for n in _names(e)}


def lint(hf_config: dict, entries: Iterable[ConfigEntry], where: str = "config.json") -> None:
    """Raise :class:`PortingError` for an unknown field or a value the family cannot represent."""
    entries = list(entries)
    unknown = sorted(set(hf_config) - known_fields(entries))
    if unknown:
        raise PortingError(
            f"{where}: unsupported field(s) {', '.join(unknown)}; they may change the model's "
            "maths and cannot be dropped silently"
        )
    for e in entries:
        if isinstance(e, Require) and e.hf in hf_config and not e.ok(hf_config[e.hf]):
            raise PortingError(f"{where}: {e.hf}={hf_config[e.hf]!r} is not supported: {e.why}")


def to_mcore(hf_config: dict, entries: Iterable[ConfigEntry], where: str = "config.json") -> dict:
    """Lint ``hf_config`` and return the Megatron config keyword arguments it determines."""
    entries = list(entries)
    lint(hf_config, entries, where)
    out: dict[str, Any] = {}
    for e in entries:
        if isinstance(e, Field):
            if e.hf in hf_config:
                out[e.mcore] = e.to_mcore(hf_config[e.hf])
            elif e.default is not _MISSING:
                out[e.mcore] = e.default
            else:
                raise PortingError(f"{where}: required field {e.hf!r} is missing")
        elif isinstance(e, Derived):
            out.update(e.to_mcore(hf_config))
    return out


def to_hf(mcore_config: Any, original: dict, entries: Iterable[ConfigEntry]) -> dict:
    """Rebuild the HF config: the original dict with every mapped field re-derived from Megatron.

    Carried and required fields come back exactly as they were; mapped fields come from the
    Megatron config, so a change made on the Megatron side (none is expected) would show.
    """
    out = dict(original)
    for e in entries:
        if isinstance(e, Field):
            if e.hf in original or getattr(mcore_config, e.mcore) != e.default:
                out[e.hf] = e.to_hf(getattr(mcore_config, e.mcore))
        elif isinstance(e, Derived):
            for k, v in e.to_hf(mcore_config).items():
                if k in original or v is not None:
                    out[k] = v
    return out


def read_hf_config(hf_dir: str | Path) -> dict:
    """Read and minimally validate ``config.json`` of an HF model directory."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise PortingError(f"{hf_dir}: not a directory")
    if not path.exists():
        raise PortingError(f"{path}: missing (is {hf_dir} a Hugging Face model directory?)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PortingError(f"{path}: invalid JSON ({err})") from err
    archs = cfg.get("architectures")
    if not archs or not isinstance(archs, list):
        raise PortingError(f"{path}: no 'architectures' list; cannot tell the model family")
    return cfg
