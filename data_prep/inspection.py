"""``porting prep-data inspect PREFIX``: counts of an indexed dataset and its first documents decoded.

The tokenizer is the one given, or else the one recorded in the ``prep-data`` report that wrote
the prefix (found next to it), so a user sees what went in without retyping flags. ``--doc N``
shows one document and, from the provenance sidecar, where it came from, checked against that
source as it is now.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data_prep import provenance
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
    doc: int | None = None,
) -> dict:
    """Counts, document-length statistics and the first ``n_docs`` documents (ids and text);
    with ``doc``, that document instead, with its provenance (:func:`document_origin`)."""
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
    side = None
    if provenance.sidecar_path(prefix).exists():
        side = provenance.read(provenance.sidecar_path(prefix), info["documents"])
        info["provenance"] = {"path": str(side.path), "sources": len(side.sources), "key": side.key}
    else:
        info["provenance"] = None
    if doc is not None and not 0 <= doc < info["documents"]:
        raise PortingError(f"--doc {doc}: {prefix} has documents 0 to {info['documents'] - 1}")
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
    for d in [doc] if doc is not None else range(min(n_docs, info["documents"])):
        a, b = doc_idx[d], doc_idx[d + 1]
        ids = np.concatenate([ds[int(s)] for s in range(a, b)]) if b > a else np.zeros(0, int)
        entry = {"document": d, "tokens": int(len(ids)), "ids": ids[:max_tokens].tolist()}
        if ref is not None:
            entry["text"] = ref.decode(ids[:max_tokens], skip_special_tokens=False)
        if doc is not None:
            if side is None:
                raise PortingError(
                    f"{provenance.sidecar_path(prefix)}: missing; this dataset was written "
                    "without provenance (--no-provenance, or by another tool)"
                )
            entry["origin"] = document_origin(side, d, ids.tolist(), ref)
        docs.append(entry)
    info["first_documents"] = docs
    return info


def document_origin(side: provenance.Sidecar, n: int, ids: list[int], ref=None) -> dict:
    """Where document ``n`` came from, and whether that source still holds its text: the text's
    hash against the recorded one and, with a tokenizer, Megatron's ids of the source text
    against the document's (its EOD aside) and the document decoded against the text. A source
    that is gone or changed is said, not raised; its text is returned only where its hash is the
    recorded one."""
    rec = side.record(n)
    src = rec["source"]
    origin = {
        "file": src["path"],
        "kind": src["kind"],
        src["unit"]: rec["record"],
        "offset": rec["offset"] if rec["offset"] >= 0 else None,
        "hash": rec["hash"],
    }
    try:
        text = provenance.source_text(src, rec["record"], rec["offset"], side.key or "text")
    except PortingError as err:
        origin["source_now"] = f"unreadable: {err}"
        return origin
    if provenance.text_hash(text) != rec["hash"]:
        origin["source_now"] = "changed: its text there no longer has the recorded hash"
        return origin
    origin["source_now"] = "unchanged"
    origin["text"] = text
    if ref is not None:
        want = ref.encode(text)
        origin["ids_match_source"] = ids == want or (
            ref.eod is not None and ids == [*want, ref.eod]
        )
        origin["decodes_to_source"] = ref.decode(ids) == text
    return origin
