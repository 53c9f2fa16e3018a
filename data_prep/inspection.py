"""``porting prep-data inspect PREFIX``: counts of an indexed dataset and its first documents decoded.

The tokenizer is the one given, or else the one recorded in the ``prep-data`` report that wrote
the prefix (found next to it), so a user sees what went in without retyping flags.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data_prep.reference import load_reference
from data_prep.report import REPORT_SUFFIX
from data_prep.tokenizer import TokenizerSource, resolve
from data_prep.writer import read_index
from porting.errors import PortingError


def find_report(prefix: str | Path) -> dict | None:
    """The ``prep-data`` report that lists ``prefix`` among its outputs, if one is beside it."""
    prefix = Path(prefix)
    for path in sorted(prefix.parent.glob(f"*{REPORT_SUFFIX}")):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        # A report sits beside its outputs, so names are compared (the paths in it are as the
        # user typed them, relative to wherever prep-data ran).
        for out in (report.get("outputs") or {}).values():
            if Path(out.get("prefix", "")).name == prefix.name:
                return report
    return None


def inspect_dataset(
    prefix: str | Path,
    tokenizer: TokenizerSource | None = None,
    include_special_tokens: bool = True,
    use_fast: bool = True,
    n_docs: int = 3,
    max_tokens: int = 64,
) -> dict:
    """Counts, document-length statistics and the first ``n_docs`` documents (ids and text)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = str(prefix)
    read_index(prefix)
    ds = IndexedDataset(prefix)
    seq_lens = np.asarray(ds.sequence_lengths, dtype=np.int64)
    doc_idx = np.asarray(ds.document_indices, dtype=np.int64)
    seqs_per_doc = np.diff(doc_idx)
    starts = np.concatenate([[0], np.cumsum(seq_lens)])
    doc_tokens = starts[doc_idx[1:]] - starts[doc_idx[:-1]]
    info = {
        "prefix": prefix,
        "dtype": np.dtype(ds.index.dtype).name,
        "documents": int(len(doc_idx) - 1),
        "sequences": int(len(seq_lens)),
        "empty_documents": int(np.count_nonzero(seqs_per_doc == 0)),
        "tokens": int(seq_lens.sum()),
        "bin_bytes": Path(prefix + ".bin").stat().st_size,
        "document_tokens": {
            "min": int(doc_tokens.min()) if len(doc_tokens) else 0,
            "mean": round(float(doc_tokens.mean()), 1) if len(doc_tokens) else 0.0,
            "max": int(doc_tokens.max()) if len(doc_tokens) else 0,
        },
    }
    ref = None
    if tokenizer is None:
        report = find_report(prefix)
        if report is not None:
            tok = report["tokenizer"]
            named = tok.get("checkpoint", {}).get("path") or tok["path"]
            try:
                tokenizer = resolve(named)
            except PortingError as err:
                raise PortingError(
                    f"the prep-data report beside {prefix} names the tokenizer {named}, which is "
                    f"not usable here ({err}); pass --tokenizer"
                ) from err
            include_special_tokens = tok.get("include_special_tokens") is not False
            use_fast = tok.get("use_fast") is not False
            info["tokenizer_from"] = "report"
    if tokenizer is not None:
        ref = load_reference(tokenizer.kind, tokenizer.path, include_special_tokens, use_fast)
        info["tokenizer"] = str(tokenizer.path)
        eod = ref.eod
        if eod is not None and info["tokens"]:
            flat = np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r")
            ends = (starts[doc_idx[1:]])[doc_tokens > 0]
            info["eod"] = eod
            info["documents_ending_in_eod"] = (
                f"{int(np.count_nonzero(flat[ends - 1] == eod))}/{len(ends)}"
            )
            del flat
    docs = []
    for d in range(min(n_docs, info["documents"])):
        a, b = doc_idx[d], doc_idx[d + 1]
        ids = np.concatenate([ds[int(s)] for s in range(a, b)]) if b > a else np.zeros(0, int)
        entry = {"document": d, "tokens": int(len(ids)), "ids": ids[:max_tokens].tolist()}
        if ref is not None:
            entry["text"] = ref.decode(ids[:max_tokens], skip_special_tokens=False)
        docs.append(entry)
    info["first_documents"] = docs
    return info
