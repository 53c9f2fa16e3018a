"""The JSON report of a run, and the progress line shown while it runs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

REPORT_SUFFIX = ".prep-report.json"


def report_path(output_prefix: str | Path) -> Path:
    """Where a run's report goes: ``{output_prefix}.prep-report.json``."""
    return Path(f"{output_prefix}{REPORT_SUFFIX}")


def cpu_seconds(children: bool = True) -> float:
    """User and system CPU of this process (and of its children waited for, such as a finished
    worker pool's): the denominator of a run's tokens per CPU-second, its per-core rate."""
    import resource

    who = [resource.RUSAGE_SELF] + ([resource.RUSAGE_CHILDREN] if children else [])
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary sibling, then rename it into place (the sibling is removed if
    writing fails or is interrupted)."""
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """:func:`write_json_atomic` for text."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Progress:
    """A tqdm bar over input bytes on disk (for the ETA) with documents/s, tokens/s and the true
    bytes/s of the decoded input in its postfix."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total,
            initial=initial,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="prep-data",
            disable=None if enabled else True,
            dynamic_ncols=True,
        )
        self._t0 = time.perf_counter()
        self.docs = self.tokens = self.bytes = self._disk = 0

    def update(self, disk_bytes: int, docs: int, tokens: int, nbytes: int) -> None:
        """Account for one finished chunk."""
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        dt = max(time.perf_counter() - self._t0, 1e-9)
        self._bar.set_postfix_str(
            f"{self.docs / dt:,.0f} docs/s, {self.tokens / dt / 1e6:.2f} Mtok/s, "
            f"{self.bytes / dt / 1e6:.1f} MB/s",
            refresh=False,
        )
        self._disk += disk_bytes
        self._bar.update(disk_bytes)

    def show(self, disk_bytes: int, docs: int, tokens: int, nbytes: int) -> None:
        """Set the totals of this run so far (from workers that report running counts)."""
        self.update(
            disk_bytes - self._disk, docs - self.docs, tokens - self.tokens, nbytes - self.bytes
        )

    def close(self) -> None:
        """Finish the bar."""
        self._bar.close()


def rate(amount: float, seconds: float) -> float:
    """amount per second, 0 for a zero-length interval."""
    return amount / seconds if seconds > 0 else 0.0
