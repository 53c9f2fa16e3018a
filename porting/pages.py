"""Pages of a mapped weight file, dropped once they are read.

A weight read from a mapped file (a safetensors shard, a ``torch_dist`` record) is a view of the
mapping, and the pages a reader touches stay resident, counted in the process's RSS, until the
mapping goes. A 163,840 x 7168 bf16 table copied that way is held twice (2.3 GB of the file's
pages and the copy); two tables compared, both. The readers register the mappings they make
(:func:`register`); :func:`check_rows`, :func:`copy_rows` and :func:`equal_rows` go a block of
rows at a time and drop each block's pages once used (``MADV_DONTNEED`` on a private mapping
nothing wrote: the data stays in the page cache and is read from it again if touched). A tensor
that views no registered mapping is read as it is, a block at a time.

A released page is read again from the file if touched, so a view whose first dimension is not
its outermost in memory costs only speed. What it must not be is written: a private mapping's
written pages would go with it. The readers hand out views for reading, and a block is released
only once copied or compared.
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BLOCK_BYTES = 64 * 2**20

# first address -> (end address, the mapping); an entry goes with its mapping
_MAPPINGS: dict[int, tuple[int, weakref.ref]] = {}


def register(mm: mmap.mmap) -> None:
    """Note ``mm``'s address range, so that views of it can be released."""
    import torch

    if len(mm) == 0:
        return
    start = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()

    def gone(ref: weakref.ref) -> None:
        if _MAPPINGS.get(start, (0, None))[1] is ref:
            del _MAPPINGS[start]

    _MAPPINGS[start] = (start + len(mm), weakref.ref(mm, gone))


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (a strided view's extent)."""
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def release(t: torch.Tensor) -> None:
    """Drop the resident pages wholly inside ``t``'s extent where ``t`` views a registered
    mapping; nothing otherwise."""
    if t.numel() == 0 or t.device.type != "cpu":
        return
    lo = t.data_ptr()
    hi = lo + _span(t)
    for start, (end, ref) in list(_MAPPINGS.items()):
        if start <= lo and hi <= end:
            mm = ref()
            if mm is None:
                return
            page = mmap.PAGESIZE
            first = math.ceil((lo - start) / page) * page
            last = (hi - start) // page * page
            if last > first:
                mm.madvise(mmap.MADV_DONTNEED, first, last - first)
            return


def _blocks(t: torch.Tensor) -> Iterator[slice]:
    """Slices of ``t``'s first dimension of about :data:`BLOCK_BYTES` each (one slice for a
    small tensor, a scalar, or one whose first dimension is not its outermost in memory)."""
    if t.dim() == 0 or t.stride(0) <= 0 or _span(t) <= BLOCK_BYTES:
        yield slice(None)
        return
    rows = max(1, BLOCK_BYTES // (t.stride(0) * t.element_size()))
    for first in range(0, t.shape[0], rows):
        yield slice(first, first + rows)


def _check(block: torch.Tensor, whole: torch.Tensor, where: str, key: str) -> None:
    """:func:`porting.errors.check_finite` of ``whole`` where ``block`` may hold a NaN or Inf:
    the error counts them over the whole tensor."""
    import torch

    from porting.errors import check_finite

    if block.is_floating_point() and not torch.isfinite(block.sum()):
        check_finite(whole, where, key)


def check_rows(t: torch.Tensor, where: str, key: str) -> None:
    """:func:`porting.errors.check_finite` a block at a time, each block released after."""
    for rows in _blocks(t):
        _check(t[rows], t, where, key)
        release(t[rows])


def copy_rows(
    dst: torch.Tensor, src: torch.Tensor, where: str | None = None, key: str = ""
) -> None:
    """``dst.copy_(src)`` (a cast where the dtypes differ) a block at a time, each block of
    ``src`` released after it is copied; with ``where``, checked finite first, as by
    :func:`check_rows`."""
    for rows in _blocks(src):
        block = src[rows]
        if where is not None:
            _check(block, src, where, key)
        dst[rows].copy_(block)
        release(block)


def equal_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)`` a block at a time, each block of both released after it is
    compared: two mapped tables are never resident together."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    for rows in _blocks(a):
        if not torch.equal(a[rows], b[rows]):
            return False
        release(a[rows])
        release(b[rows])
    return True
