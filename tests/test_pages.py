"""porting.pages: reading a registered mapping a block of rows at a time leaves at most a block of
the file resident, where a plain read leaves all of it (the mapping's Rss in /proc/self/smaps);
what is copied, compared or checked is what a plain copy, torch.equal or check_finite gives,
column slices and casts included; a non-finite value is refused by name wherever it lies; and a
tensor of no registered mapping is read as it is, never released."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from porting import pages
from porting.errors import PortingError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")

ROWS, COLS = 2048, 4096  # 16 MiB of bf16


def _mapping(tmp_path, values: torch.Tensor, name: str = "t.bin", register: bool = True):
    path = tmp_path / name
    path.write_bytes(values.contiguous().view(torch.uint8).numpy().tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if register:
        pages.register(mm)
    return mm, torch.frombuffer(mm, dtype=values.dtype).view(values.shape)


def _resident_kib(mm: mmap.mmap) -> int:
    """The Rss of the mapping that holds ``mm``'s first byte."""
    base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= base < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("the mapping is not in /proc/self/smaps")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(pages, "BLOCK_BYTES", 2**20)


@pytest.fixture
def values():
    return torch.randn(ROWS, COLS).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [slice(None), slice(100, 3000)])
def test_copy_is_a_plain_copy(tmp_path, values, dtype, cols):
    mm, view = _mapping(tmp_path, values)
    src = view[7:2001, cols]
    dst = torch.empty(src.shape, dtype=dtype)
    pages.copy_rows(dst, src, "here", "k")
    assert torch.equal(dst, values[7:2001, cols].to(dtype))


def test_reads_leave_a_block_resident(tmp_path, values):
    mm, view = _mapping(tmp_path, values)
    pages.copy_rows(torch.empty(view.shape, dtype=torch.float32), view, "here", "k")
    assert _resident_kib(mm) <= 2 * 1024  # a block of 1 MiB and a page at each end
    view.sum()
    assert _resident_kib(mm) >= 15 * 1024  # a plain read: the whole 16 MiB
    pages.check_rows(view, "here", "k")
    assert _resident_kib(mm) <= 2 * 1024
    other_mm, other = _mapping(tmp_path, values, "u.bin")
    assert pages.equal_rows(view, other)
    assert _resident_kib(mm) <= 2 * 1024 and _resident_kib(other_mm) <= 2 * 1024


def test_an_unregistered_mapping_is_read_as_it_is(tmp_path, values):
    mm, view = _mapping(tmp_path, values, register=False)
    dst = torch.empty(view.shape, dtype=view.dtype)
    pages.copy_rows(dst, view)
    assert torch.equal(dst, values)
    assert _resident_kib(mm) >= 15 * 1024  # nothing released: not known to be a file's pages


def test_equal_rows_is_torch_equal(tmp_path, values):
    _, view = _mapping(tmp_path, values)
    changed = values.clone()
    changed[1999, 5] += 1
    _, other = _mapping(tmp_path, changed, "u.bin")
    assert not pages.equal_rows(view, other)
    assert not pages.equal_rows(view, other[:-1])
    assert pages.equal_rows(view, values.clone())


@pytest.mark.parametrize("row", [0, 1500])
def test_non_finite_refused_by_name(tmp_path, values, row):
    values[row, 9] = float("nan")
    values[ROWS - 1, 0] = float("inf")
    _, view = _mapping(tmp_path, values)
    want = r"here: tensor 'k' holds 2 NaN/Inf value\(s\) of 8388608"
    with pytest.raises(PortingError, match=want):
        pages.copy_rows(torch.empty(view.shape), view, "here", "k")
    with pytest.raises(PortingError, match=want):
        pages.check_rows(view, "here", "k")
