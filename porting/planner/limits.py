"""What the planner accepts and how far it searches: every ceiling in one place.

Every number the planner reads (cluster file, model config, constants file, nccl-tests log,
flags) is checked here by name before it is used: a real number of the right kind (``true`` is
not an integer), finite, and inside a range whose ceiling is far above any real cluster or model
(docs/planner.md "Limits"). A value outside is refused with the file and the field, never tried:
an unchecked ``nodes: 10**12`` once grew the rank tables to 23 GB, and an ``.inf`` TFLOPS planned
a step of "0.00 s". Files are read with a size cap, strict UTF-8 and parser failures (nesting,
over-long numbers) turned into one error naming the file.

The search bounds (site orders, the work of the placement tables) live here too, so that the
worst accepted cluster is a stated, tested number rather than whatever the inputs allow.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from porting.errors import PortingError

# --- cluster: the largest real training clusters have ~100k-200k GPUs in a few sites
MAX_SITES = 64
MAX_GPUS = 262_144  # all sites together
MAX_GPUS_PER_NODE = 1024  # an NVLink domain (NVL72 racks are 72) modelled as one node
MAX_LINK_COUNT = 65_536

# --- search: layouts considered, and the orders of the sites a pipeline across them is tried in
MAX_LAYOUTS = 40_000  # fewer orders of the sites past it; a search past it with one is refused
MAX_SITE_ORDERS = 12  # every linked order while there are at most this many, else the best
# Steps of the depth-first walk that lists the linked orders: bounds the walk on sparse link
# graphs where partial orders die late (a ring with chords), whatever the number of sites.
MAX_ORDER_STEPS = 20_000

# --- files
# 64 fully linked sites (2016 links) take ~130 KB and ~27,000 YAML values; parsing YAML costs
# ~25 us a value in pure Python (the C loader recurses without a depth limit), so both caps
# keep a hostile file's parse to a few seconds
MAX_CLUSTER_BYTES = 512 << 10
MAX_YAML_VALUES = 100_000
MAX_CONFIG_BYTES = 16 << 20  # config.json or context/porting.json
MAX_CONSTANTS_BYTES = 64 << 10
# nccl_tests.sh (from --emit) logs a node, each site and each link: 2,081 logs of a few KB for
# 64 fully linked sites, a rank line each of up to 2 x 1024 ranks
MAX_LOG_BYTES = 1 << 20  # one nccl-tests log
MAX_LOGS = 4096
MAX_LOGS_BYTES = 64 << 20  # all of them
# grouped-GEMM shapes a --calibrate directory's logs may hold in all: a sweep is tens of rows,
# and the fit evaluates each ~2,000 times
MAX_GEMM_ROWS = 1024


@dataclass(frozen=True)
class Range:
    """The values a field accepts: ``low <= value <= high``, an integer where ``integer``."""

    low: float
    high: float
    integer: bool = False

    def check(self, value: object, where: str) -> float:
        """``value`` if it is in range, else a PortingError naming ``where`` (file: field)."""
        kind = "an integer" if self.integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PortingError(f"{where}: expected {kind}, got {show(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise PortingError(f"{where}: {show(value)} is not a finite number")
        if self.integer and not isinstance(value, int):
            raise PortingError(f"{where}: expected {kind}, got {show(value)}")
        # compared before any conversion: float(10**400) would overflow
        if value > self.high:
            raise PortingError(
                f"{where}: {show(value)} is more than the planner's limit of {show(self.high)}"
            )
        if value < self.low:
            raise PortingError(f"{where}: must be at least {show(self.low)}, got {show(value)}")
        return value


def show(value: object) -> str:
    """A short, bounded rendering of any parsed value for an error message (a YAML alias bomb's
    repr is exponential and a 4000-digit integer is not a message)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        if abs(value) < 10**30:
            return str(value)
        return f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    if value is None:
        return "nothing"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def positive_int(high: float) -> Range:
    """Integers from 1 to ``high``."""
    return Range(1, high, integer=True)


# --- requests (flags and the plan() arguments)
SEQ_LENGTH = Range(1, 1 << 24, integer=True)  # tokens per sequence
GLOBAL_BATCH = Range(1, 1 << 24, integer=True)  # sequences per step
MICRO_BATCH = Range(1, 1 << 16, integer=True)
MAX_MICRO_BATCH_SIZES = 16
STEP_SECONDS = Range(1e-6, 1e7)  # --measured-step: a microsecond to four months


def read_text(path: Path, what: str, max_bytes: int) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``; ``what`` names it in errors
    (a flag, or the file itself)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise PortingError(f"{what}: cannot read ({err.strerror or err})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PortingError(f"{what}: not a regular file")
        if info.st_size > max_bytes:
            raise PortingError(
                f"{what}: {info.st_size} bytes is more than the planner's limit of {max_bytes}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise PortingError(f"{what}: cannot read ({err.strerror or err})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise PortingError(f"{what}: more than the planner's limit of {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PortingError(f"{what}: not UTF-8 text (byte {err.start})") from None


class _TooManyValues(Exception):
    pass


def parse_yaml(text: str, source: str) -> object:
    """Parsed YAML (safe loader) of at most ``MAX_YAML_VALUES`` values; nesting too deep or a
    number too long is an error naming ``source``. Aliases are not expanded: the loader shares
    one object between them, and nothing here walks a value as a tree."""
    import yaml

    class Loader(yaml.SafeLoader):
        values = 0

        def compose_node(self, parent, index):
            self.values += 1
            if self.values > MAX_YAML_VALUES:
                raise _TooManyValues
            return super().compose_node(parent, index)

    loader = Loader(text)
    try:
        return loader.get_single_data()
    except _TooManyValues:
        raise PortingError(
            f"{source}: more than the planner's limit of {MAX_YAML_VALUES} YAML values"
        ) from None
    except yaml.YAMLError as err:
        raise PortingError(f"{source}: not valid YAML ({_first_line(err)})") from None
    except RecursionError:
        raise PortingError(f"{source}: nested too deeply to read") from None
    except ValueError as err:
        raise PortingError(f"{source}: unreadable value ({_first_line(err)})") from None
    finally:
        loader.dispose()


def parse_json(text: str, source: str) -> object:
    """Parsed JSON; the same errors as :func:`parse_yaml`."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise PortingError(f"{source}: cannot read JSON ({err})") from None
    except RecursionError:
        raise PortingError(f"{source}: nested too deeply to read") from None
    except ValueError as err:
        raise PortingError(f"{source}: unreadable value ({_first_line(err)})") from None


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
