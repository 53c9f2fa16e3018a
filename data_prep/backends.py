"""Tokenizer backends: batches of texts in, flat token arrays out.

Each backend turns a list of texts into ``(ids, lengths)``: every document's token ids laid end to
end in one int32 array, and the count per document (int64). No Python list per document survives past
the call. These run inside the worker processes, so this module imports only the tokenizer
libraries (never torch, transformers or Megatron, which take seconds to import).

A :class:`BackendSpec` is what the main process sends to the workers: small, picklable, holding
the serialized tokenizer rather than a path, so that every worker tokenizes with exactly the
object the main process checked (including what ``transformers`` changed on load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

#: Backends a user can name; ``megatron`` is the reference itself, one document at a time.
BACKENDS = ("hf", "sentencepiece", "gigatoken", "megatron")


@dataclass(frozen=True)
class BackendSpec:
    """How a worker builds its tokenizer.

    ``source`` is ``"hf-json"`` (``payload``: a ``tokenizers`` JSON string), ``"sp-model"``
    (``payload``: serialized sentencepiece model bytes) or ``"megatron"`` (``payload``: the
    arguments of :func:`data_prep.tokenizer.load_reference`). ``prefix``/``suffix`` are the
    special-token ids the reference puts around every document; backends that cannot add them
    themselves (gigatoken, sentencepiece) get them added here.
    """

    name: str
    source: str
    payload: object
    add_special_tokens: bool = False
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)


def _flatten(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    ids = np.fromiter(chain.from_iterable(lists), dtype=np.int32, count=int(lengths.sum()))
    return ids, lengths


def wrap(
    ids: np.ndarray,
    lengths: np.ndarray,
    prefix: tuple[int, ...] = (),
    suffix: tuple[int, ...] = (),
    eod: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Put ``prefix``/``suffix`` around every document and ``eod`` after every non-empty one.

    Vectorized: no loop over documents. EOD follows Megatron's ``Encoder.encode``: appended only
    when the document (with its special tokens) has at least one token.
    """
    p, s = len(prefix), len(suffix)
    if not p and not s:
        if eod is None:
            return ids, lengths
        nonempty = lengths > 0
        return np.insert(ids, np.cumsum(lengths)[nonempty], eod), lengths + nonempty
    n = len(lengths)
    new_len = lengths + (p + s)
    has_eod = (new_len > 0) if eod is not None else np.zeros(n, dtype=bool)
    new_len = new_len + has_eod
    ends = np.cumsum(new_len)
    starts = ends - new_len
    out = np.empty(int(ends[-1]) if n else 0, dtype=ids.dtype)
    if len(ids):
        old_starts = np.cumsum(lengths) - lengths
        shift = np.repeat(starts + p - old_starts, lengths)
        out[np.arange(len(ids), dtype=np.int64) + shift] = ids
    for k, tok in enumerate(prefix):
        out[starts + k] = tok
    for k, tok in enumerate(suffix):
        out[starts + p + lengths + k] = tok
    if eod is not None:
        out[ends[has_eod] - 1] = eod
    return out, new_len


class HFBackend:
    """Hugging Face ``tokenizers`` (Rust): ``encode_batch_fast``, offsets not computed."""

    def __init__(self, spec: BackendSpec) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(spec.payload)
        self._special = spec.add_special_tokens

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of ``texts``, flat, and the count per text."""
        encs = self._tok.encode_batch_fast(texts, add_special_tokens=self._special)
        return _flatten([e.ids for e in encs])

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens dropped (no clean-up of spaces)."""
        return self._tok.decode(ids, skip_special_tokens=True)


class SentencePieceBackend:
    """sentencepiece's batch ``encode`` (C++), as Megatron's ``SentencePieceTokenizer`` encodes."""

    def __init__(self, spec: BackendSpec) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(spec.payload)
        self._prefix, self._suffix = spec.prefix, spec.suffix
        self._threads = int(spec.extra.get("threads", 1))

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of ``texts``, flat, and the count per text."""
        ids, lengths = _flatten(self._sp.encode(texts, num_threads=self._threads))
        return wrap(ids, lengths, self._prefix, self._suffix)

    def decode(self, ids: list[int]) -> str:
        """Text of ids (sentencepiece drops control tokens)."""
        return self._sp.decode(ids)


class GigatokenBackend:
    """gigatoken (Rust, SIMD pretokenizer).

    Its ``encode_batch`` returns an awkward array, and importing awkward costs 0.35 s of CPU in
    a process; its per-document ``encode`` returns numpy, at about 5 us a document more (5% of
    its encoding, measured here on 100 MB and 250 MB of mixed Japanese/English). So a worker
    encodes document by document until it has encoded ``BATCH_AFTER_CHARS`` characters (a
    100 MB run never imports awkward, and the main process's probes never do), and in batches
    after that (a 1 GB run). Both give the same ids (tested).

    gigatoken caches every pretoken it has seen, for the life of the tokenizer object: measured
    here, a worker grew from 140 to 290 MB over 100 MB of mixed Japanese/English, and would keep
    growing with the corpus. The tokenizer is rebuilt after every ``RESET_CHARS`` characters, which
    bounds that growth by the interval instead of the corpus (each rebuild costs 0.08-0.15 s and
    a cold cache: every 8 M characters cost 0.25 s per worker on 100 MB, every 32 M 0.07 s).
    """

    RESET_CHARS = 32 << 20
    BATCH_AFTER_CHARS = 64 << 20

    def __init__(self, spec: BackendSpec) -> None:
        self._spec = spec
        self._prefix, self._suffix = spec.prefix, spec.suffix
        self._tok = self._build()
        self._chars = 0
        self._seen = 0

    def _build(self):
        import gigatoken as gt

        if self._spec.source == "hf-json":
            return gt.Tokenizer.from_json(self._spec.payload).backend
        return gt.Tokenizer.from_sentencepiece(self._spec.payload).backend

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of ``texts``, flat, and the count per text."""
        if self._chars >= self.RESET_CHARS:
            self._tok = None
            self._tok = self._build()
            self._chars = 0
        n = sum(map(len, texts))
        self._chars += n
        self._seen += n
        if self._seen > self.BATCH_AFTER_CHARS:
            ids, lengths = self._batch(texts)
        else:
            ids, lengths = self._each(texts)
        return wrap(ids, lengths, self._prefix, self._suffix)

    def _each(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        each = list(map(self._tok.encode, texts))
        lengths = np.fromiter(map(len, each), dtype=np.int64, count=len(each))
        # Token ids are below the vocabulary size, so reading uint32 as int32 changes no value.
        ids = np.concatenate(each).view(np.int32) if each else np.empty(0, dtype=np.int32)
        return ids, lengths

    def _batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        import awkward as ak

        # The awkward array's buffers taken apart without copies.
        layout = ak.to_layout(self._tok.encode_batch(texts, parallel=False))
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        content = np.asarray(layout.content.data)
        ids = np.ascontiguousarray(content[offsets[0] : offsets[-1]]).view(np.int32)
        return ids, np.diff(offsets)


class MegatronBackend:
    """Megatron's own tokenizer object, one document at a time: slow, exact by construction."""

    def __init__(self, spec: BackendSpec) -> None:
        from data_prep.reference import load_reference

        self._ref = load_reference(**spec.payload)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of ``texts``, flat, and the count per text."""
        return _flatten([self._ref.encode(t) for t in texts])

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens dropped."""
        return self._ref.decode(ids)


class LightReference:
    """Megatron's tokenizer without Megatron: the ``tokenizers`` object transformers loaded for it
    (``payload`` JSON) or its sentencepiece model, called as Megatron calls it.

    Megatron's ``HuggingFaceTokenizer`` gets its ids from ``tokenizer(text).input_ids`` (special
    tokens included) or ``convert_tokens_to_ids(tokenize(text))``; both come down to this object's
    ``encode``. The run checks that this holds, on probes and on the head of the corpus, against
    Megatron's own answers (:class:`data_prep.tokenizer.Facts`) before it trusts it on samples.
    """

    def __init__(self, kind: str, payload, include_special_tokens: bool) -> None:
        self.kind = kind
        self._special = include_special_tokens
        if kind == "sentencepiece":
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor()
            self._sp.LoadFromSerializedProto(payload)
        else:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(payload)

    def encode(self, text: str) -> list[int]:
        """The ids Megatron writes for ``text`` (before EOD)."""
        if self.kind == "sentencepiece":
            return self._sp.encode(text)
        return self._tok.encode(text, add_special_tokens=self._special).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens dropped, no clean-up of spaces."""
        if self.kind == "sentencepiece":
            return self._sp.decode(ids)
        return self._tok.decode(ids, skip_special_tokens=True)


def describe_diff(got: list[int], want: list[int], text: str) -> str | None:
    """None if the two encodings of ``text`` agree, else where and how they first differ."""
    if list(got) == list(want):
        return None
    k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if k is None:
        k = min(len(got), len(want))
    return (
        f"text {text[:80]!r}: token {k} differs (backend {list(got[k : k + 6])}, reference "
        f"{list(want[k : k + 6])}; lengths {len(got)} vs {len(want)})"
    )


def build_backend(spec: BackendSpec):
    """Instantiate the backend a spec names."""
    cls = {
        "hf": HFBackend,
        "sentencepiece": SentencePieceBackend,
        "gigatoken": GigatokenBackend,
        "megatron": MegatronBackend,
    }[spec.name]
    return cls(spec)
