"""Writing Megatron's indexed dataset (``.bin``/``.idx``) in bounded memory, and resumable runs.

The ``.bin`` is the documents' token ids end to end in the token dtype, which is what
``IndexedDatasetBuilder.add_document`` writes. The ``.idx`` header is the one
``megatron.core.datasets.indexed_dataset._IndexWriter`` writes (asked of it); the body
(sequence lengths, byte pointers, document indices) is streamed in blocks instead of being handed
over as Python lists: ``IndexedDatasetBuilder`` keeps two Python ints per document and
``_IndexWriter`` builds a third list of pointers, measured at 105 bytes per document of peak
memory (1 GB at ten million documents, docs/data_prep.md); streamed, the index costs the same
few tens of MB at two million documents as at twenty. Tests compare the bytes with ``IndexedDatasetBuilder``'s and read them back with
``IndexedDataset``.

A run in progress lives in ``{output_prefix}.prep-data.partial/``: per key the ``.bin`` so far,
the token count of every document (int32) and its provenance sidecar (``data_prep.provenance``),
the skipped records, and ``state.json`` saying how much of each file belongs to committed chunks. A killed run resumes from there; the outputs get
their final names only once complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from porting.errors import PortingError

BLOCK = 1 << 18
STATE = "state.json"
PROBLEMS = "problems.jsonl"


def _blocks(source, block: int = BLOCK) -> Iterable[np.ndarray]:
    """Blocks of an int32 array, or of an int32 file read a block at a time (so that even its
    page cache is not held: a memory map would count every page read against the process)."""
    if isinstance(source, np.ndarray):
        for i in range(0, len(source), block):
            yield source[i : i + block]
        return
    with open(source, "rb") as f:
        while True:
            b = np.fromfile(f, dtype=np.int32, count=block)
            if not len(b):
                return
            yield b


def index_header(dtype) -> bytes:
    """The bytes ``megatron.core``'s ``_IndexWriter`` opens an ``.idx`` of this token dtype with.

    Asked of ``_IndexWriter`` itself (it writes them to a scratch file), so the header stays
    Megatron's; the caller may then write indexes without importing megatron.core.
    """
    import tempfile

    from megatron.core.datasets.indexed_dataset import _IndexWriter

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.idx"
        with _IndexWriter(str(path), np.dtype(dtype).type):
            pass
        return path.read_bytes()


def write_index(
    idx_path: str | Path,
    header: bytes,
    itemsize: int,
    n_sequences: int,
    n_doc_entries: int,
    sequence_lengths: Callable[[], Iterable[np.ndarray]],
    document_indices: Callable[[], Iterable[np.ndarray]],
) -> None:
    """Write an ``.idx`` as ``_IndexWriter.write`` lays it out, from blocks.

    ``header`` comes from :func:`index_header`; ``itemsize`` is the token dtype's size.
    ``sequence_lengths`` and ``document_indices`` return fresh iterators over the blocks of each
    array (lengths are read twice: once written, once turned into byte pointers).
    ``n_doc_entries`` counts the leading 0 of the document indices.
    """
    with open(idx_path, "wb") as f:
        f.write(header)
        f.write(struct.pack("<Q", n_sequences))
        f.write(struct.pack("<Q", n_doc_entries))
        for block in sequence_lengths():
            f.write(np.asarray(block, dtype=np.int32).tobytes(order="C"))
        pointer = 0
        for block in sequence_lengths():
            sizes = np.asarray(block, dtype=np.int64) * itemsize
            ends = np.cumsum(sizes)
            f.write((ends - sizes + pointer).tobytes(order="C"))
            if len(ends):
                pointer += int(ends[-1])
        for block in document_indices():
            f.write(np.asarray(block, dtype=np.int64).tobytes(order="C"))


def write_index_from_doc_lengths(
    idx_path: str | Path, header: bytes, itemsize: int, doc_lengths
) -> None:
    """The ``.idx`` of documents with these token counts, one sequence per non-empty document.

    ``doc_lengths`` is an int32 array or the path of an int32 file. That is
    ``preprocess_data.py`` without sentence splitting: an empty document adds no sequence and
    repeats the previous document index.
    """
    n_docs = n_seq = 0
    for b in _blocks(doc_lengths):
        n_docs += len(b)
        n_seq += int(np.count_nonzero(b))

    def seq_lengths():
        for b in _blocks(doc_lengths):
            yield b[b > 0]

    def doc_indices():
        yield np.zeros(1, dtype=np.int64)
        seen = 0
        for b in _blocks(doc_lengths):
            counts = np.cumsum(b > 0, dtype=np.int64) + seen
            if len(counts):
                seen = int(counts[-1])
            yield counts

    write_index(idx_path, header, itemsize, n_seq, n_docs + 1, seq_lengths, doc_indices)


def total_tokens(doc_lengths) -> int:
    """Sum of an int32 array or file of document lengths, a block at a time."""
    return sum(int(b.sum(dtype=np.int64)) for b in _blocks(doc_lengths))


def _fsync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


class WorkDir:
    """The partial outputs of one run, and the state that makes them resumable."""

    def __init__(
        self, path: Path, keys: tuple[str, ...], prov_heads: dict[str, bytes] | None = None
    ) -> None:
        self.path = path
        self.keys = keys
        # Each key's sidecar header (None: no provenance).
        self.prov_heads = prov_heads
        self.state: dict = {}
        self._bins: dict = {}
        self._lens: dict = {}
        self._provs: dict = {}
        self._problems = None

    def bin_path(self, key: str) -> Path:
        """Where the tokens of ``key`` accumulate."""
        return self.path / f"{key}.bin"

    def lens_path(self, key: str) -> Path:
        """Where the per-document token counts of ``key`` accumulate (int32)."""
        return self.path / f"{key}.doclens"

    def prov_path(self, key: str) -> Path:
        """Where the provenance sidecar of ``key`` accumulates."""
        return self.path / f"{key}.prov"

    @property
    def problems_path(self) -> Path:
        """Skipped records so far, one JSON object a line."""
        return self.path / PROBLEMS

    def exists(self) -> bool:
        """Whether an interrupted run left its state here."""
        return (self.path / STATE).is_file()

    def start(self, state: dict) -> None:
        """Begin afresh (removing any earlier partial run)."""
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        self.state = state
        for key, head in (self.prov_heads or {}).items():
            self.prov_path(key).write_bytes(head)
            state["keys"][key]["prov_bytes"] = len(head)
        self._open()
        self.commit()

    def resume(self, fingerprint: str) -> dict:
        """Reopen an interrupted run, cutting every file back to its last committed chunk."""
        try:
            self.state = json.loads((self.path / STATE).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PortingError(
                f"{self.path / STATE}: unreadable ({err}); start over with --overwrite"
            ) from err
        if self.state.get("fingerprint") != fingerprint:
            raise PortingError(
                f"{self.path}: this partial run was made with other inputs, tokenizer or flags "
                "(or the inputs changed since); start over with --overwrite"
            )
        for key in self.keys:
            entry = self.state["keys"][key]
            files = [
                (self.bin_path(key), entry["bin_bytes"]),
                (self.lens_path(key), 4 * entry["documents"]),
            ]
            if self.prov_heads:
                files.append((self.prov_path(key), entry["prov_bytes"]))
            for path, size in files:
                if not path.exists() or path.stat().st_size < size:
                    raise PortingError(
                        f"{path}: shorter than its committed size; start over with --overwrite"
                    )
                os.truncate(path, size)
        if self.problems_path.stat().st_size < self.state["problems_bytes"]:
            raise PortingError(f"{self.problems_path}: truncated; start over with --overwrite")
        os.truncate(self.problems_path, self.state["problems_bytes"])
        self._open()
        return self.state

    def _open(self) -> None:
        for key in self.keys:
            self._bins[key] = open(self.bin_path(key), "ab")
            self._lens[key] = open(self.lens_path(key), "ab")
            if self.prov_heads:
                self._provs[key] = open(self.prov_path(key), "ab")
        self._problems = open(self.problems_path, "ab")

    def append(
        self, key: str, tokens: np.ndarray, doc_lens: np.ndarray, prov: np.ndarray | None = None
    ) -> None:
        """Add one chunk's documents of ``key`` and, with provenance on, their records
        (committed by the next :meth:`commit`)."""
        self._bins[key].write(tokens.tobytes(order="C"))
        self._lens[key].write(np.asarray(doc_lens, dtype=np.int32).tobytes(order="C"))
        entry = self.state["keys"][key]
        entry["bin_bytes"] += tokens.nbytes
        entry["documents"] += len(doc_lens)
        if self.prov_heads:
            data = prov.tobytes(order="C")
            self._provs[key].write(data)
            entry["prov_bytes"] += len(data)

    def add_problems(self, rows: list[dict]) -> None:
        """Record skipped records (committed by the next :meth:`commit`)."""
        if rows:
            data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)
            self._problems.write(data)
            self.state["problems_bytes"] += len(data)

    def commit(self) -> None:
        """Make everything appended so far durable, then record it in the state file."""
        for f in (
            *self._bins.values(),
            *self._lens.values(),
            *self._provs.values(),
            self._problems,
        ):
            if f is not None:
                _fsync(f)
        tmp = self.path / (STATE + ".tmp")
        try:
            tmp.write_text(json.dumps(self.state, indent=1, ensure_ascii=False))
            os.replace(tmp, self.path / STATE)
        finally:
            # a stop signal (raised as an exception) between the write and the rename must not
            # leave the half-made state beside the last committed one
            tmp.unlink(missing_ok=True)

    def flush(self) -> None:
        """Hand buffered writes to the OS (without committing them)."""
        for f in (
            *self._bins.values(),
            *self._lens.values(),
            *self._provs.values(),
            self._problems,
        ):
            if f is not None:
                f.flush()

    def close(self) -> None:
        """Close the open files (the state stays as last committed)."""
        for f in (
            *self._bins.values(),
            *self._lens.values(),
            *self._provs.values(),
            self._problems,
        ):
            if f is not None:
                f.close()
        self._bins, self._lens, self._provs, self._problems = {}, {}, {}, None

    def problems(self) -> list[dict]:
        """Every skipped record so far."""
        with open(self.problems_path, "rb") as f:
            return [json.loads(line) for line in f if line.strip()]

    def remove(self) -> None:
        """Delete the partial run."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)


def read_index(prefix: str):
    """Megatron's reader of ``prefix.idx``, after checking the pair is there, the index parses and
    the ``.bin`` has exactly the bytes it describes (a clear error instead of a traceback)."""
    from megatron.core.datasets.indexed_dataset import DType, _IndexReader

    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, bin_):
        if not p.is_file():
            raise PortingError(f"{p}: missing")
    try:
        index = _IndexReader(str(idx), multimodal=False)
    except (AssertionError, ValueError, struct.error) as err:
        raise PortingError(f"{idx}: not a Megatron index ({err})") from err
    expected = int(np.asarray(index.sequence_lengths, dtype=np.int64).sum()) * DType.size(
        index.dtype
    )
    if bin_.stat().st_size != expected:
        raise PortingError(
            f"{bin_}: {bin_.stat().st_size} bytes, but its index describes {expected}"
        )
    return index
