"""Declarative mapping of HF ``config.json`` fields onto a family's Megatron config, with a lint.

A family lists every HF field it knows, in one of four kinds:

- :class:`Field`   - one HF field is one Megatron field (optionally converted both ways);
- :class:`Derived` - several HF fields together set Megatron fields (biases, rope scaling);
- :class:`Require` - a field whose value must satisfy a check, else the maths would change in a way
  we cannot represent; the error names the field and the value;
- :class:`Carry`   - a field that does not change the maths (ids, bookkeeping); it is stored in the
  checkpoint and written back unchanged on export;
- :class:`Undecided` - a field a new family has not decided yet (``porting new-family`` writes one
  per field it cannot place); a family with any is refused, all of them listed at once.

Any HF field the family does not list is an error: an unknown field might change the maths, and we
never drop one silently.

``Field``, ``Derived`` and ``Carry`` take an optional ``check`` (:data:`POSITIVE_INT`,
:data:`POSITIVE_FLOAT`, :data:`PROBABILITY`, :data:`BOOL`, ...): the type and range the value must
have, checked for every present field before any conversion runs, so a size of ``0``, ``-1``,
``true`` or ``1.0`` and a ``rope_theta`` of ``Infinity`` are refused naming the field and the value
instead of failing later inside Megatron or a layout transform.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from porting.errors import PortingError

_MISSING = object()


def _same(v: Any) -> Any:
    return v


@dataclass(frozen=True)
class Check:
    """A constraint on one HF field's value: ``ok(value)`` must hold; ``what`` the value must be.

    ``null_ok`` lets JSON ``null`` through (for fields where transformers reads null as "derive it",
    e.g. ``head_dim`` or ``num_key_value_heads``); use :meth:`or_null` to get such a check.
    """

    ok: Callable[[Any], bool]
    what: str
    null_ok: bool = False

    def or_null(self) -> Check:
        """The same check, also accepting ``null``."""
        return replace(self, null_ok=True, what=f"{self.what} or null")

    def __call__(self, name: str, value: Any, where: str) -> None:
        if value is None and self.null_ok:
            return
        if not self.ok(value):
            raise PortingError(f"{where}: {name}={value!r} is invalid: it must be {self.what}")


def _is_int(v: Any) -> bool:
    # bool is a subclass of int in Python; JSON true/false are never sizes
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    # json.loads accepts the non-standard literals NaN, Infinity and -Infinity; an int is always
    # finite (and math.isfinite would overflow on a huge one)
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


POSITIVE_INT = Check(lambda v: _is_int(v) and v > 0, "a positive integer")
POSITIVE_FLOAT = Check(lambda v: _is_real(v) and v > 0, "a finite number > 0")
PROBABILITY = Check(lambda v: _is_real(v) and 0 <= v < 1, "a finite number in [0, 1)")
BOOL = Check(lambda v: isinstance(v, bool), "true or false")


@dataclass(frozen=True)
class Field:
    """HF field ``hf`` <-> Megatron field ``mcore``; ``default`` applies when ``hf`` is absent.

    ``check`` constrains the HF value when it is present.
    """

    hf: str
    mcore: str
    to_mcore: Callable[[Any], Any] = _same
    to_hf: Callable[[Any], Any] = _same
    default: Any = _MISSING
    check: Check | None = None


@dataclass(frozen=True)
class Derived:
    """HF fields ``hf`` jointly set Megatron fields.

    ``to_mcore(hf_config) -> dict`` of Megatron fields (raise PortingError for unsupported values);
    ``to_hf(mcore_config) -> dict`` of HF fields for export. ``check`` applies to each of the
    ``hf`` fields that is present.
    """

    hf: tuple[str, ...]
    to_mcore: Callable[[dict], dict]
    to_hf: Callable[[Any], dict]
    check: Check | None = None


@dataclass(frozen=True)
class Require:
    """HF field ``hf`` must satisfy ``ok(value)`` when present; ``why`` explains the constraint."""

    hf: str
    ok: Callable[[Any], bool]
    why: str


@dataclass(frozen=True)
class Carry:
    """HF field ``hf`` does not change the maths; it is carried through export unchanged.

    ``check`` constrains it where the engine reads it all the same (``vocab_size``).
    """

    hf: str
    check: Check | None = None


@dataclass(frozen=True)
class Undecided:
    """HF field ``hf`` is still to decide (its value in the config the family was started from
    was ``seen``): map it, carry it or require a value. Refused until then."""

    hf: str
    seen: Any = None


ConfigEntry = Field | Derived | Require | Carry | Undecided


def undecided(entries: Iterable[ConfigEntry]) -> list[Undecided]:
    """The entries still to decide."""
    return [e for e in entries if isinstance(e, Undecided)]


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
        if isinstance(e, Field) and e.default is _MISSING and e.hf not in hf_config:
            raise PortingError(f"{where}: required field {e.hf!r} is missing")
        if isinstance(e, Field | Derived | Carry) and e.check is not None:
            for name in _names(e):
                if name in hf_config:
                    e.check(name, hf_config[name], where)
    for e in entries:
        if isinstance(e, Require) and e.hf in hf_config and not e.ok(hf_config[e.hf]):
            raise PortingError(f"{where}: {e.hf}={hf_config[e.hf]!r} is not supported: {e.why}")


def to_mcore(hf_config: dict, entries: Iterable[ConfigEntry], where: str = "config.json") -> dict:
    """Lint ``hf_config`` and return the Megatron config keyword arguments it determines."""
    entries = list(entries)
    lint(hf_config, entries, where)
    out: dict[str, Any] = {}
    for e in entries:
        # A conversion that trips over a value no check described (a rope_scaling object without
        # its factor, say) is still bad input: name the field(s) rather than show a traceback.
        try:
            if isinstance(e, Field):
                # lint has refused a missing field without a default
                out[e.mcore] = e.to_mcore(hf_config[e.hf]) if e.hf in hf_config else e.default
            elif isinstance(e, Derived):
                out.update(e.to_mcore(hf_config))
        except (KeyError, TypeError, ValueError, ArithmeticError) as err:
            fields = ", ".join(f"{n}={hf_config.get(n)!r}" for n in _names(e))
            raise PortingError(
                f"{where}: cannot convert {fields} ({type(err).__name__}: {err})"
            ) from err
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


def _hub_blobs(model_dir: Path) -> Path | None:
    """The ``blobs`` folder of a Hugging Face hub cache entry when ``model_dir`` is one of its
    snapshots (``models--org--name/snapshots/<revision>``), else ``None``.

    ``huggingface_hub`` stores every snapshot file as a symlink to ``../../blobs/<hash>``, so a
    snapshot's files legitimately resolve outside the snapshot folder, into that one place.
    """
    if model_dir.parent.name == "snapshots" and model_dir.parent.parent.name.startswith("models--"):
        return (model_dir.parent.parent / "blobs").resolve()
    return None


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def model_file(path: str | Path, model_dir: str | Path) -> Path:
    """Check that ``path`` may be read as a file of the HF directory ``model_dir``; return it.

    Refuses, naming the file, what ``open()`` would block on or misread (a FIFO, a device, a
    socket, a directory) and a symlink that leaves the model directory (a checkpoint's files must
    not reach elsewhere on the machine). The one exception is a Hugging Face hub cache snapshot,
    whose files are symlinks into the entry's ``blobs`` folder (:func:`_hub_blobs`).
    Call it before every ``open()`` of a file named by the checkpoint.
    """
    path = Path(path)
    root = Path(model_dir).resolve()
    try:
        st = os.stat(path)  # follows symlinks: the kind of what open() would reach
    except FileNotFoundError as err:
        raise PortingError(f"{path}: missing (or a dangling symlink)") from err
    except OSError as err:
        raise PortingError(f"{path}: cannot be read ({err.strerror})") from err
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _NOT_REGULAR if test(st.st_mode)), "a special file")
        raise PortingError(f"{path}: is {kind}, not a regular file; refusing to open it")
    real = path.resolve()
    blobs = _hub_blobs(root)
    if not real.is_relative_to(root) and not (blobs is not None and real.is_relative_to(blobs)):
        raise PortingError(
            f"{path}: resolves to {real}, outside the model directory {root}; refusing to read it"
        )
    return path


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads`` ``object_pairs_hook`` refusing a repeated key (``json`` keeps the last)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def read_json(path: Path, model_dir: str | Path) -> Any:
    """Parse a JSON file of the HF directory, naming the file on any failure.

    Duplicate keys are refused (``json`` would silently keep the last one).
    """
    model_file(path, model_dir)
    try:
        return json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except UnicodeDecodeError as err:
        raise PortingError(f"{path}: not UTF-8 text ({err})") from err
    except (ValueError, RecursionError) as err:  # JSONDecodeError, duplicate key, deep nesting
        raise PortingError(f"{path}: invalid JSON ({err})") from err
    except OSError as err:
        raise PortingError(f"{path}: cannot be read ({err.strerror})") from err


def read_hf_config(hf_dir: str | Path) -> dict:
    """Read ``config.json`` of an HF model directory and check its shape.

    Every file of the directory must pass :func:`model_file` first: the tokenizer and generation
    files are opened by ``transformers`` and copied by us, and a FIFO among them would hang the
    command. ``config.json`` must be a JSON object whose ``architectures`` names exactly one
    architecture: porting converts one architecture per checkpoint, and a second entry would
    otherwise be ignored.
    """
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise PortingError(f"{hf_dir}: not a directory")
    if not path.exists() and not path.is_symlink():
        raise PortingError(f"{path}: missing (is {hf_dir} a Hugging Face model directory?)")
    for entry in sorted(Path(hf_dir).iterdir()):
        if not entry.is_dir():  # subfolders are reached only through an index, checked there
            model_file(entry, hf_dir)
    cfg = read_json(path, hf_dir)
    if not isinstance(cfg, dict):
        raise PortingError(f"{path}: must be a JSON object, not a JSON {_json_kind(cfg)}")
    archs = cfg.get("architectures")
    if not archs or not isinstance(archs, list):
        raise PortingError(f"{path}: no 'architectures' list; cannot tell the model family")
    if len(archs) != 1 or not isinstance(archs[0], str):
        raise PortingError(
            f"{path}: architectures={archs!r} must name exactly one architecture (a string); "
            "porting converts one architecture per checkpoint"
        )
    return cfg


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )
