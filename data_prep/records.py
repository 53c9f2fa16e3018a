"""From raw JSONL bytes (or dataset rows) to the texts to tokenize, naming what is wrong with the rest.

Runs inside the tokenizing worker processes, so it imports nothing heavy. A record is one JSON line
(or one dataset row); it is usable when it is at most ``--max-record-bytes`` long and a JSON object
whose every ``--json-keys`` value is a non-empty string of valid Unicode. Anything else is a problem
of one of :data:`PROBLEM_KINDS`, reported with its line (1-based, counted per file) by the caller;
nothing a line holds raises out of :func:`parse_jsonl`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import orjson

#: What can be wrong with a record, in the order the checks run (a dataset row's size is checked
#: last, once its values are known to be text).
PROBLEM_KINDS = (
    "record_too_large",
    "invalid_utf8",
    "malformed_json",
    "not_object",
    "missing_key",
    "not_string",
    "empty_text",
)

#: Skipped records listed in the report, per kind; the rest are counted only. A corpus with a
#: million bad lines must not need a million entries in memory and in the report.
PROBLEMS_LISTED = 100

_MISSING = object()


def listed(counts: dict[str, int], kind: str) -> bool:
    """Count one problem of ``kind`` in ``counts``; True while it is among the first
    :data:`PROBLEMS_LISTED` of its kind (the ones the report lists)."""
    counts[kind] = counts.get(kind, 0) + 1
    return counts[kind] <= PROBLEMS_LISTED


def refuse_empty(records: int, skipped: int, problems: dict[str, int], allow_empty: bool) -> None:
    """A run that kept no record at all is an error unless ``--allow-empty`` asked for it: a
    corpus every line of which was skipped (or that holds none) is a wrong input, not a dataset."""
    if records or allow_empty:
        return
    from porting.errors import PortingError

    why = ", ".join(f"{n} {k}" for k, n in problems.items() if n) or "the inputs hold no record"
    raise PortingError(
        f"no record kept ({skipped} skipped: {why}); nothing written. Pass --allow-empty to "
        "write an empty dataset"
    )


@dataclass
class Parsed:
    """The usable records of one chunk, column by key, and the problems of the others.

    ``lines`` holds the chunk-relative (0-based) line of each usable record and ``offsets`` the
    chunk-relative byte offset of that line (None for dataset rows); ``problems`` holds
    ``(line, kind, detail)``; ``n_lines`` counts every line of the chunk, usable or not.
    """

    texts: dict[str, list[str]]
    lines: list[int] = field(default_factory=list)
    offsets: list[int] | None = None
    problems: list[tuple[int, str, str]] = field(default_factory=list)
    n_lines: int = 0
    nbytes: int = 0


def _fallback_parse(line: bytes) -> tuple[object, tuple[str, str] | None]:
    """Parse a line orjson refused: (object, None), or (None, (kind, detail)) saying why not.

    orjson refuses some JSON the stdlib (and so Megatron's script) accepts: NaN, lone surrogate
    escapes such as ``"\\ud800"``. The stdlib decides; a text the tokenizer could not take is then
    caught by :func:`check_value`.
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, ("invalid_utf8", f"invalid UTF-8 at byte {err.start} of the line")
    if line.startswith(b"\xef\xbb\xbf"):
        return None, ("malformed_json", "line starts with a UTF-8 byte-order mark")
    if not line.strip():
        return None, ("malformed_json", "blank line")
    try:
        # The text, not the bytes: json.loads guesses the encoding of bytes from their first
        # four (two NULs first read as UTF-32 and fail with UnicodeDecodeError); Megatron's
        # script reads the file as UTF-8 text.
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, ("malformed_json", str(err))
    except ValueError as err:
        # An integer of more than sys.get_int_max_str_digits() digits (4300).
        return None, ("malformed_json", str(err).split(";")[0])
    except RecursionError:
        return None, ("malformed_json", "nested too deeply")


def check_value(value) -> tuple[str, str] | None:
    """The problem with one key's value, or None when it is a usable text."""
    if value is _MISSING:
        return "missing_key", ""
    if type(value) is not str:
        kind = "null" if value is None else type(value).__name__
        return "not_string", f"value is {kind}, not a string"
    if not value:
        return "empty_text", "empty string"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        return "invalid_utf8", f"lone surrogate at character {err.start}"
    return None


def too_large(size: int, max_record: int) -> tuple[str, str]:
    """The problem of a record of ``size`` bytes over the ``--max-record-bytes`` limit."""
    return "record_too_large", f"{size} bytes > --max-record-bytes {max_record}"


def oversize(length: int, span: int, keys: tuple[str, ...], max_record: int) -> Parsed:
    """One line the planner measured and skipped unread (``span`` bytes with its newline)."""
    return Parsed(
        {k: [] for k in keys},
        problems=[(0, *too_large(length, max_record))],
        n_lines=1,
        nbytes=span,
    )


def parse_jsonl(
    data: bytes,
    keys: tuple[str, ...],
    keep_empty: bool,
    stop_at_first: bool,
    max_record: int | None = None,
) -> Parsed:
    """Parse the complete lines in ``data`` (the last may lack its newline).

    ``keep_empty`` keeps empty strings as (empty) documents, as Megatron's ``preprocess_data.py``
    does; otherwise they are problems. ``stop_at_first`` returns at the first problem (the caller
    will stop there anyway), leaving ``n_lines`` at the lines looked at. A line longer than
    ``max_record`` bytes (without its newline) is a ``record_too_large`` problem, not parsed.
    """
    out = Parsed({k: [] for k in keys}, nbytes=len(data), offsets=[])
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    columns = [out.texts[k] for k in keys]
    loads = orjson.loads
    offsets = out.offsets
    end = 0
    for i, line in enumerate(lines):
        start, end = end, end + len(line) + 1
        if max_record is not None and len(line) > max_record:
            out.problems.append((i, *too_large(len(line), max_record)))
            if stop_at_first:
                out.n_lines = i + 1
                return out
            continue
        strict = True
        try:
            obj = loads(line)
        except orjson.JSONDecodeError:
            obj, bad = _fallback_parse(line)
            strict = False
            if bad is not None:
                out.problems.append((i, *bad))
                if stop_at_first:
                    out.n_lines = i + 1
                    return out
                continue
        if type(obj) is not dict:
            out.problems.append((i, "not_object", f"a JSON {type(obj).__name__}, not an object"))
            if stop_at_first:
                out.n_lines = i + 1
                return out
            continue
        values = [obj.get(k, _MISSING) for k in keys]
        problem = None
        for k, v in zip(keys, values, strict=True):
            # orjson yields only valid Unicode, so its non-empty strings need no further check.
            if strict and type(v) is str and v:
                continue
            if keep_empty and v == "":
                continue
            bad = check_value(v)
            if bad is not None:
                problem = (i, bad[0], f"key {k!r}: {bad[1]}" if bad[1] else f"key {k!r} missing")
                break
        if problem is not None:
            out.problems.append(problem)
            if stop_at_first:
                out.n_lines = i + 1
                return out
            continue
        for col, v in zip(columns, values, strict=True):
            col.append(v)
        out.lines.append(i)
        offsets.append(start)
    out.n_lines = len(lines)
    return out


def parse_rows(
    columns: dict[str, list],
    keys: tuple[str, ...],
    keep_empty: bool,
    stop_at_first: bool,
    max_record: int | None = None,
) -> Parsed:
    """Check dataset rows (one list per key, equal lengths) as :func:`parse_jsonl` checks lines;
    a row is too large when its texts together exceed ``max_record`` bytes of UTF-8."""
    n = len(columns[keys[0]])
    out = Parsed({k: [] for k in keys})
    nbytes = 0
    for i in range(n):
        problem = None
        for k in keys:
            v = columns[k][i]
            if keep_empty and v == "":
                continue
            bad = check_value(v)
            if bad is not None:
                problem = (i, bad[0], f"key {k!r}: {bad[1]}")
                break
        size = 0
        if problem is None:
            size = sum(len(columns[k][i].encode("utf-8")) for k in keys)
            if max_record is not None and size > max_record:
                problem = (i, *too_large(size, max_record))
        if problem is not None:
            out.problems.append(problem)
            if stop_at_first:
                out.n_lines = i + 1
                out.nbytes = nbytes
                return out
            continue
        for k in keys:
            out.texts[k].append(columns[k][i])
        nbytes += size
        out.lines.append(i)
    out.n_lines = n
    out.nbytes = nbytes
    return out
