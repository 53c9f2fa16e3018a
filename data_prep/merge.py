"""``porting prep-data merge``: several ``.bin``/``.idx`` pairs into one, as ``merge_datasets.py``.

Megatron-LM's ``tools/merge_datasets.py`` takes every pair in a directory (sorted by prefix) and
chains them with ``IndexedDatasetBuilder.add_index``; the result here is byte-identical, but the
index is streamed from the inputs' memory-mapped indexes rather than gathered into Python lists.
The inputs' provenance sidecars are chained the same way (:mod:`data_prep.provenance`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from data_prep import provenance
from data_prep.writer import index_header, read_index, write_index
from porting.errors import PortingError
from porting.guard import check_outputs, output_lock


def prefixes_in(directory: str | Path) -> list[str]:
    """Every ``.bin``/``.idx`` pair in a directory, sorted (``merge_datasets.py``'s order)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PortingError(f"{directory}: not a directory")
    found = set()
    for p in directory.iterdir():
        if p.is_file() and p.suffix in (".bin", ".idx"):
            other = p.with_suffix(".idx" if p.suffix == ".bin" else ".bin")
            if not other.is_file():
                raise PortingError(f"{other}: missing (its pair {p.name} is there)")
            found.add(str(p.with_suffix("")))
    if not found:
        raise PortingError(f"{directory}: no .bin/.idx pairs")
    return sorted(found)


def merge(
    prefixes: list[str],
    output_prefix: str | Path,
    overwrite: bool = False,
    input_dir: str | Path | None = None,
    record_bases: list[int] | None = None,
    sources: list[dict] | None = None,
) -> dict:
    """Concatenate datasets in the given order into ``output_prefix``; return counts.

    ``input_dir``, the directory the prefixes were listed from (``--input``), is an input too: an
    output inside it would be merged into itself by the next run over that directory.

    One writer per output prefix, as for ``prep-data`` (:func:`porting.guard.output_lock`); the
    temporary ``.tmp`` files are removed however the merge ends, SIGTERM included.

    Where any input has a provenance sidecar the output gets one, their sources listed once; an
    input without one (Megatron's own) stands as a source of kind ``dataset`` for its documents.
    ``record_bases`` (a job's units) is added to each input's records: a unit counts the lines of
    its own byte range; ``sources`` (a job's inputs) are the output's sources, in that order,
    whichever of them the inputs name.
    """
    if not prefixes:
        raise PortingError("nothing to merge")
    check_outputs(
        [("dataset", Path(f"{p}{ext}")) for p in prefixes for ext in (".bin", ".idx", ".prov")]
        + [("--input directory", input_dir)],
        # the temporary files too: one that is a link to an input would be written through
        writes=[
            ("--output-prefix", Path(f"{output_prefix}{ext}"))
            for ext in (".bin", ".idx", ".prov", ".bin.tmp", ".idx.tmp", ".prov.tmp")
        ],
    )
    with output_lock(output_prefix, "dataset"):
        return _merge(prefixes, output_prefix, overwrite, record_bases, sources)


def _provenance_blocks(prefixes, counts, sides, record_bases, sources=None):
    """The output's sidecar header and a generator of its records' blocks."""
    entries: list[dict] = list(sources or ())
    where = {json.dumps(e, sort_keys=True): i for i, e in enumerate(entries)}

    def index_of(entry: dict) -> int:
        token = json.dumps(entry, sort_keys=True)
        if token not in where:
            where[token] = len(entries)
            entries.append(entry)
        return where[token]

    maps = []
    for p, side in zip(prefixes, sides, strict=True):
        if side is None:
            maps.append(index_of(provenance.dataset_entry(p)))
        else:
            maps.append(np.array([index_of(e) for e in side.sources], dtype=np.uint32))
    keys = {side.key for side in sides if side is not None}

    def blocks():
        for i, (n, side, remap) in enumerate(zip(counts, sides, maps, strict=True)):
            base = record_bases[i] if record_bases else 0
            if side is None:
                for a in range(0, n, provenance.BLOCK):
                    b = min(n, a + provenance.BLOCK)
                    yield provenance.records(
                        remap, np.arange(a + 1, b + 1), None, np.zeros(b - a, np.uint64)
                    )
                continue
            for block in side.block_records():
                block["source"] = remap[block["source"]]
                block["record"] += base
                yield block

    return provenance.header(entries, keys.pop() if len(keys) == 1 else None), blocks()


def _merge(
    prefixes: list[str], output_prefix: str | Path, overwrite: bool, record_bases, sources
) -> dict:
    out_bin, out_idx = Path(f"{output_prefix}.bin"), Path(f"{output_prefix}.idx")
    out_prov = provenance.sidecar_path(output_prefix)
    for p in (out_bin, out_idx, out_prov):
        if p.exists() and not overwrite:
            raise PortingError(f"{p} exists; pass --overwrite to replace it")
    out_bin.parent.mkdir(parents=True, exist_ok=True)
    indexes = [read_index(str(p)) for p in prefixes]
    dtype = indexes[0].dtype
    for p, index in zip(prefixes, indexes, strict=True):
        if index.dtype != dtype:
            raise PortingError(
                f"{p}: token dtype {np.dtype(index.dtype).name} differs from "
                f"{prefixes[0]}'s {np.dtype(dtype).name} (different tokenizers?)"
            )
    n_seq = sum(len(ix.sequence_lengths) for ix in indexes)
    counts = [len(ix.document_indices) - 1 for ix in indexes]
    n_docs = 1 + sum(counts)
    sides = [
        provenance.read(provenance.sidecar_path(p), n)
        if provenance.sidecar_path(p).exists()
        else None
        for p, n in zip(prefixes, counts, strict=True)
    ]
    with_provenance = any(side is not None for side in sides)

    def seq_lengths():
        for ix in indexes:
            yield from (
                ix.sequence_lengths[i : i + (1 << 20)]
                for i in range(0, len(ix.sequence_lengths), 1 << 20)
            )

    def doc_indices():
        yield np.zeros(1, dtype=np.int64)
        offset = 0
        for ix in indexes:
            di = ix.document_indices
            for i in range(1, len(di), 1 << 20):
                yield np.asarray(di[i : i + (1 << 20)], dtype=np.int64) + offset
            offset += len(ix.sequence_lengths)

    tmp_bin = out_bin.with_name(out_bin.name + ".tmp")
    tmp_idx = out_idx.with_name(out_idx.name + ".tmp")
    tmp_prov = out_prov.with_name(out_prov.name + ".tmp")
    try:
        with open(tmp_bin, "wb") as f:
            for p in prefixes:
                with open(str(p) + ".bin", "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 22)
        itemsize = np.dtype(dtype).itemsize
        write_index(tmp_idx, index_header(dtype), itemsize, n_seq, n_docs, seq_lengths, doc_indices)
        if with_provenance:
            provenance.write(
                tmp_prov, *_provenance_blocks(prefixes, counts, sides, record_bases, sources)
            )
        os.replace(tmp_bin, out_bin)
        os.replace(tmp_idx, out_idx)
        provenance.place(tmp_prov if with_provenance else None, output_prefix)
    finally:
        for t in (tmp_bin, tmp_idx, tmp_prov):
            t.unlink(missing_ok=True)
    return {
        "output_prefix": str(output_prefix),
        "inputs": [str(p) for p in prefixes],
        "documents": n_docs - 1,
        "sequences": n_seq,
        "dtype": np.dtype(dtype).name,
        "provenance": str(out_prov) if with_provenance else None,
        # the inputs whose documents the sidecar knows only by their number in them
        "provenance_unknown": [str(p) for p, s in zip(prefixes, sides, strict=True) if s is None]
        if with_provenance
        else [],
    }
