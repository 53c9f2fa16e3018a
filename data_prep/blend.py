"""``porting prep-data blend``: the weighted ``--data`` blend of several prepared corpora.

Megatron draws each sample of a blend from corpus *i* with probability ``w_i / sum(w)``, and every
sample is ``--seq-length`` tokens, so a corpus's weight is its share of the training tokens. The
user gives shares for the corpora they care about (``PREFIX=0.3`` or ``PREFIX=30%``); the corpora
given without one split what is left in proportion to their token counts (all without: the
natural blend, each corpus as much as it has). With ``--train-tokens`` each corpus's epochs follow:
a share that repeats a corpus many times is said, not hidden.

The counts come from each ``.idx`` and ``.bin`` (read here, checked against each other; no
Megatron import), and a blend of corpora written with different tokenizers is refused where their
``prep-data`` reports say so.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from porting.errors import PortingError

_MAGIC = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType codes and their sizes
_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 8, 8: 2}
_DTYPE = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
          8: "uint16"}  # fmt: skip
#: Past this many epochs of one corpus a blend is flagged: repeated tokens lose value after about
#: four passes (Muennighoff et al., "Scaling Data-Constrained Language Models", 2023).
EPOCHS_FLAGGED = 4.0


@dataclass(frozen=True)
class Corpus:
    """One prepared corpus: its counts and what wrote it."""

    prefix: str
    documents: int
    tokens: int
    dtype: str
    tokenizer: str | None  # the fingerprint its prep-data report gives, if one is beside it


def corpus_counts(prefix: str | Path) -> Corpus:
    """Documents, tokens and token dtype of ``prefix.idx``/``.bin``, checked against each other."""
    import numpy as np

    prefix = str(prefix)
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, bin_):
        if p.exists() and not p.is_file():
            raise PortingError(f"{p}: not a regular file")
        if not p.is_file():
            raise PortingError(f"{p}: missing (give the prefix, e.g. out/corpus_text_document)")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != _MAGIC:
            raise PortingError(f"{idx}: not a Megatron index")
        (version,) = struct.unpack_from("<Q", head, 9)
        code = head[17]
        n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
        if version != 1 or code not in _ITEMSIZE or n_doc < 1:
            raise PortingError(f"{idx}: not a Megatron index (version {version}, dtype {code})")
        if size != 34 + 12 * n_seq + 8 * n_doc:
            raise PortingError(f"{idx}: {size} bytes, but its header describes {n_seq} sequences")
        tokens = 0
        left = n_seq
        while left:
            block = np.fromfile(f, dtype="<i4", count=min(left, 1 << 22))
            tokens += int(block.sum(dtype=np.int64))
            left -= len(block)
    if bin_.stat().st_size != tokens * _ITEMSIZE[code]:
        raise PortingError(
            f"{bin_}: {bin_.stat().st_size} bytes, but its index describes {tokens} tokens"
        )
    from data_prep.inspection import find_report

    report = find_report(prefix)
    fingerprint = report.get("tokenizer", {}).get("fingerprint") if report else None
    return Corpus(prefix, n_doc - 1, tokens, _DTYPE[code], fingerprint)


def parse_item(item: str) -> tuple[str, float | None]:
    """``PREFIX``, ``PREFIX=0.3`` or ``PREFIX=30%`` -> (prefix, share or None)."""
    m = re.fullmatch(r"(.+?)=([0-9.eE+-]+)(%?)", item)
    if m is None:
        return item, None
    try:
        share = float(m.group(2)) / (100 if m.group(3) else 1)
    except ValueError:
        raise PortingError(f"{item}: the share after '=' is not a number") from None
    if not 0 < share <= 1 or not math.isfinite(share):
        raise PortingError(f"{item}: a share is a fraction in (0, 1] or a percentage in (0, 100]")
    return m.group(1), share


def blend(items: list[str], train_tokens: float | None = None) -> dict:
    """Each corpus's weight (its share of the training tokens) and, with ``train_tokens``, the
    tokens it gives and its epochs."""
    if not items:
        raise PortingError("give at least one prepared corpus (PREFIX or PREFIX=SHARE)")
    parsed = [parse_item(i) for i in items]
    seen: set[str] = set()
    for prefix, _ in parsed:
        if prefix in seen:
            raise PortingError(f"{prefix}: named twice")
        seen.add(prefix)
        if any(c.isspace() for c in prefix):
            # Megatron reads a blend file (--data-args-path) split at whitespace
            raise PortingError(f"{prefix!r}: a prefix with whitespace cannot be in a blend")
    corpora = [corpus_counts(p) for p, _ in parsed]
    for c in corpora:
        if c.dtype != corpora[0].dtype:
            raise PortingError(
                f"{c.prefix}: tokens are {c.dtype}, {corpora[0].prefix}'s {corpora[0].dtype}: "
                "corpora of different tokenizers cannot be blended"
            )
    known = {c.tokenizer for c in corpora if c.tokenizer}
    if len(known) > 1:
        a = next(c for c in corpora if c.tokenizer)
        b = next(c for c in corpora if c.tokenizer and c.tokenizer != a.tokenizer)
        raise PortingError(
            f"{b.prefix} and {a.prefix} were written with different tokenizers (their prep-data "
            "reports' fingerprints differ): corpora of different tokenizers cannot be blended"
        )
    given = sum(s for _, s in parsed if s is not None)
    rest = [c for c, (_, s) in zip(corpora, parsed, strict=True) if s is None]
    if given > 1 + 1e-9:
        raise PortingError(f"the shares sum to {given:g}, more than 1")
    if not rest and abs(given - 1) > 1e-6:
        raise PortingError(
            f"the shares sum to {given:g}; make them sum to 1, or leave one corpus without a "
            "share to take the rest"
        )
    if rest and given >= 1 - 1e-9:
        raise PortingError(
            f"the shares sum to 1, which leaves nothing for {rest[0].prefix} (given no share)"
        )
    rest_tokens = sum(c.tokens for c in rest)
    if rest and rest_tokens == 0:
        raise PortingError(f"{rest[0].prefix}: no tokens to share what is left by")
    rows = []
    for c, (_, s) in zip(corpora, parsed, strict=True):
        share = s if s is not None else (1 - given) * c.tokens / rest_tokens
        if c.tokens == 0 and share > 0:
            raise PortingError(f"{c.prefix}: a share of {share:g} of a corpus with no tokens")
        row = {"prefix": c.prefix, "documents": c.documents, "tokens": c.tokens,
               "share": share, "given": s is not None}  # fmt: skip
        if train_tokens is not None:
            row["train_tokens"] = share * train_tokens
            row["epochs"] = share * train_tokens / c.tokens
            row["flagged"] = row["epochs"] > EPOCHS_FLAGGED
        rows.append(row)
    return {
        "corpora": rows,
        "tokens": sum(c.tokens for c in corpora),
        "train_tokens": train_tokens,
        "tokenizer": known.pop() if known else None,
        "tokenizer_unknown": [c.prefix for c in corpora if not c.tokenizer],
        "data": blend_args(rows),
    }


def blend_args(rows: list[dict]) -> list[str]:
    """``W1 PREFIX1 W2 PREFIX2 ...``: ``porting train --data``, Megatron's ``--data-path``, and
    (one line) the file ``--data-args-path`` reads."""
    return [x for r in rows for x in (f"{r['share']:.12g}", r["prefix"])]
