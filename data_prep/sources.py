"""Inputs: JSONL files and globs, ``.jsonl.gz``, local Hugging Face datasets; cut into chunks.

A chunk is a run of whole lines (or rows) of one input, about ``chunk_bytes`` long. Plain files
are cut by seeking, and the workers read their own byte ranges; gzip files are decompressed here
and sent as bytes; dataset rows are sent as Python lists. A chunk's position is an offset into
the decoded stream (bytes) or a row number, so a resumed run can start exactly where the last
committed chunk ended.

Input is bounded before anything is read: only regular files (and directories) are inputs, checked
with ``stat`` so that a FIFO is never opened (``open`` would wait for a writer forever) and a
character device such as ``/dev/zero`` is never read. A line longer than ``max_record`` bytes,
where a chunk is cut, becomes an ``oversize`` task of its own: it is skipped over 64 KiB at a time
and reaches no worker, so a 200 MB line costs neither 200 MB of memory nor a tokenizer call. Lines
over the limit inside a chunk (when ``max_record`` is below ``chunk_bytes``) are at most a chunk
long and are found by :func:`data_prep.records.parse_jsonl`.
"""

from __future__ import annotations

import glob
import gzip
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from porting.errors import PortingError

_JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_SEEK_BLOCK = 1 << 16
#: --max-record-bytes: one JSONL line (or dataset row) at most this long is tokenized. The
#: ``tokenizers`` library holds about 220 bytes per token of a text while it encodes it (measured:
#: 2.8 GB for one 20 MB line), so this limit is what bounds a worker's memory.
MAX_RECORD_BYTES = 64 << 20


@dataclass(frozen=True)
class Source:
    """One input: ``kind`` is ``jsonl``, ``jsonl.gz``, ``parquet`` or ``hf-dataset``."""

    path: Path
    kind: str
    size: int
    mtime_ns: int

    @property
    def unit(self) -> str:
        """What the numbers in problem locations count."""
        return "row" if self.kind in ("parquet", "hf-dataset") else "line"


@dataclass(frozen=True)
class Task:
    """A chunk of work: ``payload`` goes to a worker, the rest stays with the main process."""

    source_index: int
    start: int
    end: int
    payload: tuple
    disk_bytes: int


def _is_dataset_dir(path: Path) -> bool:
    return any((path / m).is_file() for m in _DATASET_MARKERS)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _what(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _source(path: Path) -> Source:
    # stat, never open: opening a FIFO blocks until a writer appears, /dev/zero never ends.
    try:
        st = os.stat(path)
    except OSError as err:
        raise PortingError(f"--input {path}: cannot read ({err.strerror})") from err
    if stat.S_ISDIR(st.st_mode):
        return Source(path, "hf-dataset", _dir_size(path), st.st_mtime_ns)
    if not stat.S_ISREG(st.st_mode):
        raise PortingError(
            f"--input {path}: {_what(st.st_mode)}, not a regular file; prep-data reads files "
            "whose size is known (copy a stream to a file first)"
        )
    name = path.name.lower()
    if name.endswith(".gz"):
        kind = "jsonl.gz"
    elif name.endswith(".parquet"):
        kind = "parquet"
    else:
        kind = "jsonl"
    return Source(path, kind, st.st_size, st.st_mtime_ns)


def expand_inputs(patterns: list[str]) -> list[Source]:
    """Files, globs and directories, in the order given (each glob sorted), without duplicates.

    A directory is a saved Hugging Face dataset when it has ``save_to_disk``'s markers; otherwise
    every JSONL file directly in it is taken (NeMo's ``--preproc-folder``).
    """
    sources, seen = [], set()
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise PortingError(f"--input {pattern}: matches no file")
        else:
            if not os.path.exists(pattern):
                raise PortingError(f"--input {pattern}: no such file or directory")
            matches = [pattern]
        for match in matches:
            path = Path(match)
            if path.is_dir() and not _is_dataset_dir(path):
                # Not is_file(): a FIFO or device named *.jsonl is refused by _source, not skipped.
                files = sorted(
                    p for p in path.iterdir() if not p.is_dir() and p.name.endswith(_JSONL_SUFFIXES)
                )
                if not files:
                    raise PortingError(
                        f"{path}: neither a saved dataset nor a folder of JSONL files"
                    )
            else:
                files = [path]
            for f in files:
                key = f.resolve()
                if key not in seen:
                    seen.add(key)
                    sources.append(_source(f))
    if not sources:
        raise PortingError("no input")
    return sources


def _newline_at(f, pos: int, size: int) -> int:
    """The offset of the first newline at or after ``pos`` (``size`` when there is none), read
    64 KiB at a time."""
    f.seek(pos)
    while pos < size:
        block = f.read(_SEEK_BLOCK)
        if not block:
            return size
        k = block.find(b"\n")
        if k >= 0:
            return pos + k
        pos += len(block)
    return size


def _line_start(f, pos: int, lo: int) -> int:
    """The offset of the line holding byte ``pos``: just past the last newline before it, or
    ``lo``; read backwards 64 KiB at a time."""
    end = pos
    while end > lo:
        start = max(lo, end - _SEEK_BLOCK)
        f.seek(start)
        k = f.read(end - start).rfind(b"\n")
        if k >= 0:
            return start + k + 1
        end = start
    return lo


def _oversize(i: int, start: int, end: int, length: int, max_record: int) -> Task:
    """A line of ``length`` bytes (without its newline) over the limit: no worker reads it."""
    return Task(i, start, end, ("oversize", length, end - start, max_record), end - start)


def _plain_tasks(
    i: int,
    src: Source,
    start: int,
    chunk_bytes: int,
    max_record: int | None,
    stop: int | None = None,
) -> Iterator[Task]:
    # ``stop`` is a line end (a unit's end, :func:`line_ranges`), so no chunk crosses it.
    stop = src.size if stop is None else stop
    with open(src.path, "rb") as f:
        pos = start
        while pos < stop:
            cut = min(pos + chunk_bytes, stop) - 1  # the chunk's last byte, nominally
            nl = _newline_at(f, cut, src.size)
            end = min(nl + 1, src.size)
            if max_record is not None and nl - pos > max_record:
                # The line through the cut may be over the limit: measure it without reading it.
                line = _line_start(f, cut, pos)
                if nl - line > max_record:
                    if line > pos:
                        yield Task(i, pos, line, ("range", str(src.path), pos, line), line - pos)
                    yield _oversize(i, line, end, nl - line, max_record)
                    pos = end
                    continue
            yield Task(i, pos, end, ("range", str(src.path), pos, end), end - pos)
            pos = end


def _skip_line(f) -> tuple[int, bool]:
    """Read to just past the next newline, 64 KiB at a time; (bytes read, newline found)."""
    n = 0
    while True:
        block = f.readline(_SEEK_BLOCK)
        n += len(block)
        if not block or block.endswith(b"\n"):
            return n, bool(block)


def _gzip_tasks(
    i: int, src: Source, start: int, chunk_bytes: int, max_record: int | None
) -> Iterator[Task]:
    with open(src.path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as f:
        # A gzip stream cannot seek: resuming re-reads (but does not re-tokenize) what was done.
        skipped = 0
        while skipped < start:
            got = len(f.read(min(chunk_bytes, start - skipped)))
            if not got:
                break
            skipped += got
        pos, disk = start, raw.tell()
        while True:
            oversize = None
            try:
                data = f.read(chunk_bytes)
                if data and not data.endswith(b"\n"):
                    line = data.rfind(b"\n") + 1
                    have = len(data) - line
                    if max_record is None:
                        data += f.readline()
                    else:
                        # At most enough of the line's rest to tell whether it is over the limit.
                        rest = f.readline(max(0, max_record - have) + 1)
                        length = have + len(rest) - rest.endswith(b"\n")
                        if length <= max_record:
                            data += rest
                        else:
                            more = 0
                            if not rest.endswith(b"\n"):
                                more, newline = _skip_line(f)
                                length += more - newline
                            oversize = (line, have + len(rest) + more, length)
            except (OSError, EOFError) as err:
                raise PortingError(f"{src.path}: corrupt gzip stream ({err})") from err
            if not data:
                return
            now = raw.tell()
            if oversize is not None:
                line, span, length = oversize
                if line:
                    yield Task(i, pos, pos + line, ("bytes", data[:line]), 0)
                yield Task(
                    i, pos + line, pos + line + span, ("oversize", length, span, max_record),
                    now - disk,
                )  # fmt: skip
                pos, disk = pos + line + span, now
                continue
            yield Task(i, pos, pos + len(data), ("bytes", data), now - disk)
            pos, disk = pos + len(data), now


def _dataset_columns(src: Source, keys: tuple[str, ...], split: str | None):
    """The requested columns of a saved dataset, as a pyarrow table (memory-mapped)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(src.path))
    except (FileNotFoundError, ValueError) as err:
        raise PortingError(f"{src.path}: cannot load the saved dataset ({err})") from err
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise PortingError(f"{src.path}: splits {sorted(ds)}; choose one with --hf-split")
            split = next(iter(ds))
        if split not in ds:
            raise PortingError(f"{src.path}: no split {split!r} (has {sorted(ds)})")
        ds = ds[split]
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise PortingError(f"{src.path}: no column {missing[0]!r} (columns: {ds.column_names})")
    # Slicing through the dataset (arrow format) honours an indices mapping, if any.
    ds = ds.select_columns(list(keys)).with_format("arrow")
    return ds.num_rows, ds.data.nbytes, lambda a, b: ds[a:b]


def _parquet_columns(src: Source, keys: tuple[str, ...]):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(src.path, columns=None, memory_map=True)
    except Exception as err:  # pyarrow raises its own hierarchy for unreadable files
        raise PortingError(f"{src.path}: cannot read parquet ({err})") from err
    missing = [k for k in keys if k not in table.column_names]
    if missing:
        raise PortingError(f"{src.path}: no column {missing[0]!r} (columns: {table.column_names})")
    table = table.select(list(keys))
    return table.num_rows, table.nbytes, lambda a, b: table.slice(a, b - a)


def _row_tasks(
    i: int, src: Source, rows_source, start: int, chunk_bytes: int, keys: tuple[str, ...]
) -> Iterator[Task]:
    n, nbytes, get = rows_source
    per_row = max(1, nbytes // max(n, 1))
    rows = max(1, chunk_bytes // per_row)
    pos = start
    while pos < n:
        end = min(n, pos + rows)
        part = get(pos, end)
        cols = {k: part.column(k).to_pylist() for k in keys}
        yield Task(i, pos, end, ("rows", cols), src.size * (end - pos) // n)
        pos = end


def iter_tasks(
    sources: list[Source],
    keys: tuple[str, ...],
    chunk_bytes: int,
    resume_source: int = 0,
    resume_offset: int = 0,
    split: str | None = None,
    max_record: int | None = None,
) -> Iterator[Task]:
    """Every chunk of every input from the resume point on, in order.

    ``max_record``: a JSONL line longer than this (bytes, without its newline) that a chunk would
    end in becomes an ``("oversize", length, span, max_record)`` task instead of being read.
    """
    for i, src in enumerate(sources):
        if i < resume_source:
            continue
        start = resume_offset if i == resume_source else 0
        if src.kind == "jsonl":
            yield from _plain_tasks(i, src, start, chunk_bytes, max_record)
        elif src.kind == "jsonl.gz":
            yield from _gzip_tasks(i, src, start, chunk_bytes, max_record)
        else:
            table = (
                _parquet_columns(src, keys)
                if src.kind == "parquet"
                else _dataset_columns(src, keys, split)
            )
            yield from _row_tasks(i, src, table, start, chunk_bytes, keys)


def read_range(path: str, start: int, end: int) -> bytes:
    """The bytes of a plain file between two offsets (what a worker reads for a range task)."""
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def line_ranges(src: Source, span: int) -> Iterator[tuple[int, int]]:
    """Byte ranges of a plain JSONL file, each at least ``span`` bytes (but the last) and ending
    just past a newline (or at the end of the file): the same ranges for the same file."""
    with open(src.path, "rb") as f:
        pos = 0
        while pos < src.size:
            end = min(_newline_at(f, min(pos + span, src.size) - 1, src.size) + 1, src.size)
            yield pos, end
            pos = end


def range_tasks(
    src: Source,
    start: int,
    end: int | None,
    keys: tuple[str, ...],
    chunk_bytes: int,
    split: str | None = None,
    max_record: int | None = None,
) -> Iterator[Task]:
    """The chunks of one input between two line ends of a plain file (``end``), or of the whole
    input (``end`` None: gzip streams and datasets are not cut)."""
    if end is not None:
        yield from _plain_tasks(0, src, start, chunk_bytes, max_record, stop=end)
    else:
        yield from iter_tasks([src], keys, chunk_bytes, 0, 0, split, max_record)


def lines_before(path: str | Path, offset: int) -> int:
    """How many newlines a file has before ``offset`` (to place a record found in a range)."""
    n = done = 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 22, offset - done))
            if not block:
                break
            n += block.count(b"\n")
            done += len(block)
    return n
