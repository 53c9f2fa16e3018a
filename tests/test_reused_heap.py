"""guard.ReusedHeap: inside it a freed activation serves the next one of its size (no fresh pages
for the kernel to fault in and zero), its step() keeps the heap's resident size bounded, and on
exit each freed tensor goes back to the OS again.

Each case runs in a fresh interpreter: glibc's settings are process-wide and the suite's own
process has allocated under other ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

PRELUDE = textwrap.dedent(
    """
    import json, resource, torch
    from porting import guard

    def faults(times=20, mib=16):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(times):
            t = torch.ones(mib << 18)  # every page written
            del t
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    """
)


def _run(body: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def _active():
    got = _run(
        """
        guard.return_freed_memory()
        with guard.ReusedHeap() as heap:
            active = heap._libc is not None
        print(json.dumps({"active": active}))
        """
    )
    if not got["active"]:  # musl, or glibc before 2.33: no mallinfo2, and the gate maps as before
        pytest.skip("this C library has no ReusedHeap")


def test_freed_blocks_are_reused_inside_and_returned_after():
    got = _run(
        """
        guard.return_freed_memory()
        faults()  # the first pages of anything the loop touches
        mapped = faults()
        before = resident()
        with guard.ReusedHeap():
            faults()  # the heap grows to what the loop needs
            reused = faults()
            inside = resident()
        after = resident()
        print(json.dumps({"mapped": mapped, "reused": reused, "inside": inside - before,
                          "after": after - before}))
        """
    )
    # 20 blocks of 16 MiB: mapped afresh, each is ~4096 pages (or 8 huge pages) faulted in
    assert got["reused"] * 10 < got["mapped"], got
    assert got["inside"] >= 15 << 20, got  # the freed block, kept
    assert got["after"] < 4 << 20, got  # and given back on exit


def test_no_op_without_return_freed_memory():
    got = _run(
        """
        heap = guard.ReusedHeap()
        with heap:
            heap.step()
            active = heap._libc is not None
        print(json.dumps({"active": active}))
        """
    )
    assert got == {"active": False}


def test_step_trims_the_heap_past_its_slack():
    got = _run(
        """
        guard.return_freed_memory()
        with guard.ReusedHeap(slack=32 << 20) as heap:
            heap.step()
            start = resident()
            # 96 MiB of 8 MiB blocks, all alive at once: the heap grows past the slack
            blocks = [torch.ones(2 << 20) for _ in range(12)]
            grown = resident()
            del blocks
            kept = resident()  # freed, and kept for reuse
            heap.step()
            trimmed = resident()
        print(json.dumps({"start": start, "grown": grown, "kept": kept, "trimmed": trimmed}))
        """
    )
    mib = 1 << 20
    assert got["grown"] - got["start"] > 90 * mib, got
    assert got["kept"] - got["start"] > 90 * mib, got
    assert got["trimmed"] - got["start"] < 16 * mib, got


def test_a_nested_one_leaves_the_outer_one_in_effect():
    got = _run(
        """
        guard.return_freed_memory()
        with guard.ReusedHeap():
            faults()
            with guard.ReusedHeap() as inner:
                nested = inner._libc is not None
            reused = faults()  # the inner one's exit restored nothing
        print(json.dumps({"nested": nested, "reused": reused}))
        """
    )
    assert got["nested"] is False
    assert got["reused"] < 2000, got  # not 20 x 4096 pages mapped afresh
