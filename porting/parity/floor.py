"""The gate's floor: both sides' matmul work at this machine's fp32 matmul rate.

The rate is measured once per machine and kept: the device's model, the torch version and the
thread count name it, and it is measured at one fixed shape, a 7B layer's MLP projection over the
default prompts' ~240 positions (:data:`RATE_SHAPE`), so that import and verify, a tiny model and
a 70B compute their floors from the same number. Measured at each model's own shape in each run,
a tiny model's rate was timing overhead: 0.3 GFLOP/s in one command (printed as 0) against 124 in
the next on the same checkpoint, and floors that disagreed with each other.

The cache is one small JSON file, ``matmul-rate.json`` in :func:`default_cache_dir`
(``~/.cache/porting`` by default). An entry that does not parse, is for another shape, or holds a rate that
is not a finite number in ``(0, RATE_MAX]`` is measured again and replaced; the file is written
under a temporary name beside it and renamed, so a reader never sees half of one. A measurement
taken while other jobs loaded the machine reads low: a gate whose floor matters takes one more
short sample and the cache keeps the better rate (:func:`machine_gflops`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from porting import cache

log = logging.getLogger(__name__)

# [rows, k] x [n, k]^T: a 7B's gate/up projection (4096 -> 11008) over ~240 prompt positions.
RATE_SHAPE = (256, 4096, 11008)
# No fp32 device does a petaFLOP/s: a cached rate above it was written by hand or by a bug.
RATE_MAX = 1e6
# Below this floor the gate's fixed costs (reading configs and headers, building both models on
# the meta device, the tokenizer: 0.2 to 1 s whatever the size) outweigh its matmuls, and the
# ratio measures those, not how close the gate runs to the machine.
FLOOR_MIN_S = 1.0
CACHE_FORMAT = 1
CACHE_NAME = "matmul-rate.json"


def default_cache_dir() -> Path:
    """Where the rate is kept (:func:`porting.cache.cache_dir`)."""
    return cache.cache_dir()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def machine_key(device: torch.device) -> str:
    """What the rate depends on: the device's model, the torch version (its BLAS), and on the
    CPU the thread count the gate computes with."""
    device = torch.device(device)
    if device.type == "cuda":
        name = f"cuda {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        name = f"{device.type} {_cpu_model()}, {torch.get_num_threads()} threads"
    return f"{name}; torch {torch.__version__}"


def measure_gflops(
    device: torch.device, rows: int, k: int, n: int, samples: int = 5, sample_s: float = 0.05
) -> float:
    """fp32 ``F.linear`` GFLOP/s on ``device`` for ``[rows, k] x [n, k]^T``, TF32 off: the best
    of ``samples`` timings after a warm-up (a floor is what the machine can do; two shared cores
    vary by 20% from run to run). A sample repeats the product until it lasts ``sample_s``, so
    that a fast device is not timed at its clock's resolution."""
    device = torch.device(device)
    # Random values (a GPU's clock follows the bits its products toggle: constants run faster),
    # but ``w`` tiled from 1024 random rows: drawing 45 M normals for the rate's shape was 0.2 s
    # of each gate's re-sample.
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.rand(rows, k, generator=g, device=device) - 0.5
    block = torch.rand(min(n, 1024), k, generator=g, device=device) - 0.5
    w = block.repeat(-(-n // block.shape[0]), 1)[:n]
    cuda = device.type == "cuda"
    tf32 = torch.backends.cuda.matmul.allow_tf32 if cuda else None

    def timed(reps: int) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t) / reps

    try:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
        reps = max(1, min(10_000, math.ceil(sample_s / max(timed(1), 1e-9))))
        best = min(timed(reps) for _ in range(samples))
    finally:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2.0 * rows * k * n / max(best, 1e-12) / 1e9


def _valid_rate(entry) -> float | None:
    """The rate of a cache entry, or None where it is not one this code would have written."""
    if not isinstance(entry, dict) or entry.get("shape") != list(RATE_SHAPE):
        return None
    rate = entry.get("gflops")
    if isinstance(rate, bool) or not isinstance(rate, int | float):
        return None
    return float(rate) if math.isfinite(rate) and 0 < rate <= RATE_MAX else None


def _read_rates(path: Path) -> dict:
    """The cache's entries (empty where it is missing, unreadable or not our format)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        return {}
    rates = data.get("rates")
    return dict(rates) if isinstance(rates, dict) else {}


def _write_rates(path: Path, rates: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": CACHE_FORMAT, "rates": rates}, indent=2, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def machine_gflops(
    device: torch.device | str, cache_dir: Path | str | None = None, work_flop: float = 0.0
) -> float:
    """This machine's fp32 matmul rate on ``device`` in GFLOP/s: the cached one for
    :func:`machine_key`, else measured at :data:`RATE_SHAPE` and cached.

    ``cache_dir``: where the cache file lives (default :func:`default_cache_dir`). A cache that
    cannot be written costs a measurement per run, never the gate (a read-only home).
    ``work_flop``: the gate's matmul work; where it makes a floor of :data:`FLOOR_MIN_S` or more,
    one more short sample is taken (about 0.1 s) and the cache keeps the better rate, so that a
    rate first measured on a loaded machine does not stay low.
    """
    device = torch.device(device)
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / CACHE_NAME
    key = machine_key(device)
    rates = _read_rates(path)
    rate = _valid_rate(rates.get(key))
    if rate is not None and work_flop / (rate * 1e9) < FLOOR_MIN_S:
        return rate
    measured = measure_gflops(device, *RATE_SHAPE, samples=5 if rate is None else 1)
    if rate is not None and measured <= rate:
        return rate
    rate = measured
    # measured: any entry that parses is kept; a corrupt one is replaced by this measurement
    rates = {k: v for k, v in rates.items() if _valid_rate(v) is not None}
    rates[key] = {
        "gflops": rate,
        "shape": list(RATE_SHAPE),
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        _write_rates(path, rates)
    except OSError as err:
        log.debug("the matmul rate could not be cached at %s: %s", path, err)
    return rate


def format_rate(gflops: float) -> str:
    """A rate as printed: whole GFLOP/s from 10 up, two significant digits below (never 0)."""
    return f"{gflops:.0f} GFLOP/s" if gflops >= 10 else f"{gflops:.2g} GFLOP/s"


def format_work(tflop: float) -> str:
    """Matmul work as printed: TFLOP from 0.1 up, GFLOP below (a tiny model's is not 0.00)."""
    return f"{tflop:.2f} TFLOP" if tflop >= 0.1 else f"{tflop * 1e3:.3g} GFLOP"


def format_seconds(s: float) -> str:
    """A duration as printed: seconds from 0.1 s up, milliseconds below."""
    return f"{s:.1f} s" if s >= 0.1 else f"{s * 1e3:.2g} ms"
