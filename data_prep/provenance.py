"""Where each document of a dataset came from: the ``.prov`` sidecar beside its ``.bin``/``.idx``.

Megatron's reader ignores the file; ``porting prep-data inspect --doc N`` reads it. Layout
(little-endian):

- 8 bytes ``PORTPROV``, 4 bytes the format version (1), 8 bytes the length of a JSON header;
- the header: ``{"format", "key", "hash", "sources": [{"path", "kind", "unit", "size",
  "mtime_ns", "split"}, ...]}``, the sources as absolute paths;
- then one 28-byte record per document of the dataset, in its order (:data:`RECORD`):
  ``source`` (index into the sources), ``record`` (the 1-based line of a JSONL file, of the
  decompressed stream of a ``.jsonl.gz``, or the 1-based row of a dataset), ``offset`` (the byte
  offset of that line, decompressed for ``.jsonl.gz``; -1 for a row) and ``hash`` (the first 8
  bytes of BLAKE2b of the document's text in UTF-8, read as a little-endian integer).

The header comes first and the records after it, so that a run appends each chunk's records as it
commits the chunk, and a resume cuts the file back to its committed size, as it does the tokens.
A merge of datasets some of which have no sidecar (Megatron's own) points their documents at a
source of kind ``dataset`` (the input prefix, ``record`` the 1-based document, hash unknown: 0).
Nothing in a sidecar is trusted: its header is plain JSON checked field by field, a source index
past the list or a size that is not whole records is refused naming the file, and a source it
names is read only where it is a regular file (a directory for a saved dataset), its text shown
only where it has the recorded hash.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from porting.errors import PortingError

MAGIC = b"PORTPROV"
VERSION = 1
SUFFIX = ".prov"
FORMAT = "porting prep-data provenance"
HASH = "blake2b-64 of the text's UTF-8 bytes, little-endian"
RECORD = np.dtype([("source", "<u4"), ("record", "<u8"), ("offset", "<i8"), ("hash", "<u8")])
_PREAMBLE = struct.Struct("<8sIQ")
#: A header past this is not one we wrote (a million sources take ~200 MB).
MAX_HEADER = 1 << 30
BLOCK = 1 << 20


def sidecar_path(prefix: str | Path) -> Path:
    """The sidecar of the dataset ``prefix`` (``out/corpus_text_document.prov``)."""
    return Path(f"{prefix}{SUFFIX}")


def source_entry(src, split: str | None = None) -> dict:
    """The header's entry for an input (a :class:`data_prep.sources.Source`)."""
    return {
        "path": str(Path(src.path).resolve()),
        "kind": src.kind,
        "unit": src.unit,
        "size": src.size,
        "mtime_ns": src.mtime_ns,
        "split": split if src.kind == "hf-dataset" else None,
    }


def dataset_entry(prefix: str | Path) -> dict:
    """The entry standing for a merged dataset that has no sidecar: its documents are known by
    their number in it, not by where they came from."""
    return {
        "path": str(Path(str(prefix)).resolve()),
        "kind": "dataset",
        "unit": "document",
        "size": None,
        "mtime_ns": None,
        "split": None,
    }


def header(sources: list[dict], key: str | None) -> bytes:
    """The bytes a sidecar starts with."""
    meta = {"format": FORMAT, "key": key, "hash": HASH, "sources": sources}
    body = json.dumps(meta, ensure_ascii=False).encode()
    return _PREAMBLE.pack(MAGIC, VERSION, len(body)) + body


def text_hashes(texts: list[str]) -> np.ndarray:
    """The ``hash`` field of each text."""
    b2 = hashlib.blake2b
    digests = b"".join(b2(t.encode("utf-8"), digest_size=8).digest() for t in texts)
    return np.frombuffer(digests, dtype="<u8").copy() if texts else np.empty(0, "<u8")


def records(source: int, lines, offsets, hashes: np.ndarray) -> np.ndarray:
    """One record per document: ``lines`` 1-based, ``offsets`` absolute (None for rows)."""
    out = np.empty(len(hashes), dtype=RECORD)
    out["source"] = source
    out["record"] = lines
    out["offset"] = -1 if offsets is None else offsets
    out["hash"] = hashes
    return out


_ENTRY_TYPES = {
    "path": (str,),
    "kind": (str,),
    "unit": (str,),
    "size": (int, type(None)),
    "mtime_ns": (int, type(None)),
    "split": (str, type(None)),
}
_KINDS = ("jsonl", "jsonl.gz", "parquet", "hf-dataset", "dataset")


@dataclass
class Sidecar:
    """A sidecar read and checked: its header, and its records (memory-mapped)."""

    path: Path
    key: str | None
    sources: list[dict]
    start: int
    count: int

    def block_records(self) -> Iterator[np.ndarray]:
        """The records a block at a time, each checked to name a source of the header."""
        with open(self.path, "rb") as f:
            f.seek(self.start)
            done = 0
            while done < self.count:
                block = np.fromfile(f, dtype=RECORD, count=min(BLOCK, self.count - done))
                if not len(block):
                    raise PortingError(f"{self.path}: shorter than its records")
                self._check(block, done)
                done += len(block)
                yield block

    def record(self, n: int) -> dict:
        """Document ``n``'s record, with its source's entry."""
        if not 0 <= n < self.count:
            raise PortingError(f"document {n}: the dataset has documents 0 to {self.count - 1}")
        with open(self.path, "rb") as f:
            f.seek(self.start + n * RECORD.itemsize)
            block = np.frombuffer(f.read(RECORD.itemsize), dtype=RECORD)
        self._check(block, n)
        (row,) = block
        return {
            "source": self.sources[int(row["source"])],
            "record": int(row["record"]),
            "offset": int(row["offset"]),
            "hash": f"{int(row['hash']):016x}",
        }

    def _check(self, block: np.ndarray, first: int) -> None:
        bad = np.flatnonzero(block["source"] >= len(self.sources))
        if len(bad):
            n = first + int(bad[0])
            raise PortingError(
                f"{self.path}: document {n} names source {int(block['source'][bad[0]])}, but the "
                f"header lists {len(self.sources)}"
            )


def read(path: str | Path, documents: int | None = None) -> Sidecar:
    """Open a sidecar, checking its header and size (and, given ``documents``, that it has one
    record per document of its dataset)."""
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise PortingError(f"{path}: not a regular file")
        with open(path, "rb") as f:
            pre = f.read(_PREAMBLE.size)
            if len(pre) < _PREAMBLE.size or pre[:8] != MAGIC:
                raise PortingError(f"{path}: not a prep-data provenance file")
            _, version, length = _PREAMBLE.unpack(pre)
            if version != VERSION:
                raise PortingError(f"{path}: provenance format {version}, this release reads 1")
            if length > min(MAX_HEADER, st.st_size - _PREAMBLE.size):
                raise PortingError(f"{path}: header of {length} bytes past the file's end")
            raw = f.read(length)
    except OSError as err:
        raise PortingError(f"{path}: {err.strerror or err}") from err
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise PortingError(f"{path}: header is not JSON ({err})") from err
    sources = meta.get("sources") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(sources, list):
        raise PortingError(f"{path}: header is not a provenance header")
    if meta.get("hash") != HASH or not isinstance(meta.get("key"), (str, type(None))):
        raise PortingError(f"{path}: header names another hash or a key that is not text")
    for i, entry in enumerate(sources):
        ok = isinstance(entry, dict) and set(entry) == set(_ENTRY_TYPES)
        ok = ok and all(
            type(entry[k]) in types for k, types in _ENTRY_TYPES.items()
        )  # bool is not an int here
        if not ok or entry["kind"] not in _KINDS:
            raise PortingError(f"{path}: source {i} of the header is not a source entry")
    start = _PREAMBLE.size + length
    body = st.st_size - start
    if body % RECORD.itemsize:
        raise PortingError(
            f"{path}: {body} bytes of records, not a whole number of {RECORD.itemsize}-byte ones"
        )
    side = Sidecar(path, meta["key"], sources, start, body // RECORD.itemsize)
    if documents is not None and side.count != documents:
        raise PortingError(
            f"{path}: {side.count} documents' provenance, but its dataset has {documents}"
        )
    return side


def write(path: Path, head: bytes, blocks: Iterable[np.ndarray]) -> int:
    """Write a sidecar from its header and its records' blocks; return the documents written."""
    n = 0
    with open(path, "wb") as f:
        f.write(head)
        for block in blocks:
            f.write(np.ascontiguousarray(block, dtype=RECORD).tobytes())
            n += len(block)
    return n


def place(made: Path | None, final: str | Path) -> None:
    """Give a finished sidecar its name beside the pair ``final``; without one (--no-provenance,
    or a merge of datasets none of which had one), remove an earlier run's, which would describe
    other documents (replacing that run's outputs took --overwrite)."""
    if made is not None:
        os.replace(made, sidecar_path(final))
    else:
        sidecar_path(final).unlink(missing_ok=True)


def _regular(path: Path, what: str) -> os.stat_result:
    try:
        st = path.stat()
    except OSError as err:
        raise PortingError(f"{path}: {what} is gone ({err.strerror})") from err
    if what == "saved dataset":
        if not stat.S_ISDIR(st.st_mode):
            raise PortingError(f"{path}: the saved dataset is not a directory")
    elif not stat.S_ISREG(st.st_mode):
        raise PortingError(f"{path}: the {what} is not a regular file")
    return st


def _line_at(f, offset: int, limit: int) -> bytes:
    if offset:
        f.seek(offset)
    line = f.readline(limit + 1)
    if len(line) > limit:
        raise PortingError(f"the line at byte {offset} is longer than {limit} bytes")
    return line


def source_text(entry: dict, record: int, offset: int, key: str, limit: int = 64 << 20) -> str:
    """The text of ``key`` of one record of a source, as prep-data read it (or an error saying
    why it cannot be read). The caller compares its hash before showing it."""
    kind, path = entry["kind"], Path(entry["path"])
    if kind == "dataset":
        raise PortingError(f"{path}: merged without provenance; its document {record} is all")
    if kind in ("jsonl", "jsonl.gz"):
        st = _regular(path, "input file")
        if offset < 0 or (kind == "jsonl" and offset >= st.st_size):
            raise PortingError(f"{path}: offset {offset} outside the file")
        try:
            with open(path, "rb") as raw:
                if kind == "jsonl":
                    line = _line_at(raw, offset, limit)
                else:
                    with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                        left = offset
                        while left:
                            got = len(f.read(min(left, 1 << 22)))
                            if not got:
                                raise PortingError(f"{path}: offset {offset} past the stream's end")
                            left -= got
                        line = _line_at(f, 0, limit)
        except (OSError, EOFError, zlib.error) as err:
            raise PortingError(f"{path}: cannot read it ({err})") from err
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise PortingError(f"{path}:{record}: not the JSON line prep-data read") from err
        value = obj.get(key) if isinstance(obj, dict) else None
    else:
        if record < 1:
            raise PortingError(f"{path}: row {record} does not exist")
        _regular(path, "input file" if kind == "parquet" else "saved dataset")
        try:
            if kind == "parquet":
                import pyarrow.parquet as pq

                table = pq.read_table(path, columns=[key], memory_map=True)
            else:
                import datasets

                ds = datasets.load_from_disk(str(path))
                if isinstance(ds, datasets.DatasetDict):
                    ds = ds[entry["split"] or next(iter(ds))]
                table = ds.select_columns([key]).with_format("arrow").data
        except Exception as err:  # pyarrow and datasets raise their own hierarchies
            raise PortingError(f"{path}: cannot read its {key!r} column ({err})") from err
        if record > table.num_rows:
            raise PortingError(f"{path}: row {record} past its {table.num_rows} rows")
        value = table.slice(record - 1, 1).column(key).to_pylist()[0]
    if not isinstance(value, str):
        raise PortingError(f"{path}:{record}: no text under {key!r} there now")
    return value


def text_hash(text: str) -> str:
    """The hex form :meth:`Sidecar.record` gives of :func:`text_hashes`."""
    return f"{int(text_hashes([text])[0]):016x}"
