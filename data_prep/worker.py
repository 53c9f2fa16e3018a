"""The tokenizing worker: one chunk of input in, token arrays and a list of problems out.

Runs in ``spawn``-ed processes (so nothing of the parent, such as a rayon thread pool or torch,
is inherited) or, for tests, in the calling process. Imports stay light: numpy, orjson and the
tokenizer library the backend needs.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import numpy as np

from data_prep.backends import BackendSpec, LightReference, build_backend, describe_diff, wrap
from data_prep.provenance import text_hashes
from data_prep.records import oversize, parse_jsonl, parse_rows
from data_prep.sources import read_range

_STATE: dict = {}

#: Documents longer than this (characters) are not sampled: decoding (and, for gigatoken,
#: re-encoding) one 20 MB document costs seconds and gigabytes for a lossiness estimate.
SAMPLE_MAX_CHARS = 1 << 20

#: Signals the main process decides on: it kills the workers itself (SIGKILL) as it stops, so
#: that Ctrl-C or a SIGTERM sent to the whole process group gives one clean stop rather than a
#: traceback per worker and a main process racing its dying pool.
_PARENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, sent once when it starts."""

    keys: tuple[str, ...]
    backend: BackendSpec
    eod: int | None
    keep_empty: bool
    stop_at_first: bool
    dtype: str
    id_limit: int
    # (kind, payload, include_special_tokens) of the LightReference gigatoken is checked against.
    reference: tuple | None = None
    # --max-record-bytes: longer lines (or dataset rows) are record_too_large problems.
    max_record: int | None = None
    batch_chars: int = 1 << 20
    head_samples: int = 32
    # Each document's line, offset and text hash, for the provenance sidecar.
    provenance: bool = False


@dataclass
class ChunkResult:
    """What one chunk became. Lines are chunk-relative and 0-based; the main process places them.

    ``doc_lens[key]`` has one entry per usable record: its token count with EOD, 0 for an empty
    document. ``samples`` are ``(line, key, diff, text, decoded)`` for a few documents: ``diff``
    says how the backend's ids differ from the reference's (None when they agree or when the
    backend is the reference's own code), ``text``/``decoded`` are excerpts of the text and of
    decode(encode(text)) when those differ (else None). ``bad_id`` is ``(line, key, id)`` for the
    first token id at or past ``id_limit``. With provenance on, ``lines`` and ``offsets`` hold
    each document's chunk-relative line and byte offset (``offsets`` None for dataset rows) and
    ``hashes[key]`` its text's hash (:func:`data_prep.provenance.text_hashes`).
    """

    tokens: dict[str, np.ndarray]
    doc_lens: dict[str, np.ndarray]
    n_lines: int
    nbytes: int
    problems: list[tuple[int, str, str]]
    samples: list[tuple[int, str, str | None, str | None, str | None]] = field(default_factory=list)
    bad_id: tuple[int, str, int] | None = None
    lines: np.ndarray | None = None
    offsets: np.ndarray | None = None
    hashes: dict[str, np.ndarray] = field(default_factory=dict)


def _exit_with(sentinel) -> None:
    wait([sentinel])
    os._exit(1)


def ignore_parent_signals() -> None:
    """In a child process: leave SIGINT, SIGTERM and SIGHUP to the main process (which stops us)."""
    for sig in _PARENT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def init(config: WorkerConfig) -> None:
    """Process initializer: keep the config and build the backend once.

    A worker whose main process is killed would otherwise wait on its task queue forever, holding
    the terminal's pipes open; it exits as soon as the parent's sentinel closes.
    """
    parent = multiprocessing.parent_process()
    if parent is not None:
        ignore_parent_signals()
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    _STATE["config"] = config
    if config.backend.name == "megatron":
        from data_prep.tokenizer import quiet_third_party

        quiet_third_party()
    _STATE["backend"] = build_backend(config.backend)
    # Only gigatoken is a second implementation worth checking; the other backends run the very
    # code the reference runs, and decode with it.
    checker = None
    if config.backend.name == "gigatoken" and config.reference is not None:
        checker = LightReference(*config.reference)
    _STATE["checker"] = checker
    _STATE["decoder"] = checker or _STATE["backend"]


def _encode_all(backend, texts: list[str], batch_chars: int) -> tuple[np.ndarray, np.ndarray]:
    """Encode in batches of about ``batch_chars`` characters, so that the tokenizer's per-token
    objects (``tokenizers.Encoding`` keeps strings and offsets) stay bounded by the batch."""
    if not texts:
        return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
    parts_ids, parts_lens = [], []
    start, size = 0, 0
    for i, t in enumerate(texts):
        size += len(t)
        if size >= batch_chars:
            ids, lens = backend.encode(texts[start : i + 1])
            parts_ids.append(ids)
            parts_lens.append(lens)
            start, size = i + 1, 0
    if start < len(texts) or not parts_ids:
        ids, lens = backend.encode(texts[start:])
        parts_ids.append(ids)
        parts_lens.append(lens)
    if len(parts_ids) == 1:
        return parts_ids[0], parts_lens[0]
    return np.concatenate(parts_ids), np.concatenate(parts_lens)


def _sample(line: int, key: str, text: str, raw: list[int]) -> tuple:
    checker = _STATE["checker"]
    diff = describe_diff(raw, checker.encode(text), text) if checker is not None else None
    decoded = _STATE["decoder"].decode(raw)
    if decoded == text:
        return (line, key, diff, None, None)
    # Excerpts around the first difference: a document's head often round-trips fine.
    k = next((i for i, (a, b) in enumerate(zip(text, decoded, strict=False)) if a != b), None)
    k = min(len(text), len(decoded)) if k is None else k
    start = max(0, k - 60)
    return (line, key, diff, text[start : k + 120], decoded[start : k + 120])


def run(payload: tuple, head: bool = False) -> ChunkResult:
    """Parse, tokenize and check one chunk (``head``: the first chunk of the run, sampled more)."""
    cfg: WorkerConfig = _STATE["config"]
    backend = _STATE["backend"]
    kind, checks = payload[0], (cfg.keys, cfg.keep_empty, cfg.stop_at_first, cfg.max_record)
    if kind == "range":
        parsed = parse_jsonl(read_range(*payload[1:]), *checks)
    elif kind == "bytes":
        parsed = parse_jsonl(payload[1], *checks)
    elif kind == "oversize":
        parsed = oversize(payload[1], payload[2], cfg.keys, payload[3])
    else:
        parsed = parse_rows(payload[1], *checks)
    result = ChunkResult({}, {}, parsed.n_lines, parsed.nbytes, parsed.problems)
    if cfg.provenance:
        result.lines = np.asarray(parsed.lines, dtype=np.int64)
        if parsed.offsets is not None:
            result.offsets = np.asarray(parsed.offsets, dtype=np.int64)
    n = len(parsed.lines)
    picks = sorted(set(range(min(n, cfg.head_samples)) if head else ({0, n // 2} if n else ())))
    dtype = np.dtype(cfg.dtype)
    for key in cfg.keys:
        texts = parsed.texts[key]
        ids, lens = _encode_all(backend, texts, cfg.batch_chars)
        starts = np.cumsum(lens) - lens
        for d in picks:
            if len(texts[d]) > SAMPLE_MAX_CHARS:
                continue
            result.samples.append(
                _sample(
                    parsed.lines[d], key, texts[d], ids[starts[d] : starts[d] + lens[d]].tolist()
                )
            )
        ids, lens = wrap(ids, lens, eod=cfg.eod)
        if len(ids) and result.bad_id is None and (ids.min() < 0 or ids.max() >= cfg.id_limit):
            bad = np.flatnonzero((ids < 0) | (ids >= cfg.id_limit))
            if len(bad):
                doc = int(np.searchsorted(np.cumsum(lens), bad[0], side="right"))
                result.bad_id = (parsed.lines[doc], key, int(ids[bad[0]]))
        if cfg.provenance:
            result.hashes[key] = text_hashes(texts)
        result.tokens[key] = ids.astype(dtype)
        result.doc_lens[key] = lens.astype(np.int32)
    return result
