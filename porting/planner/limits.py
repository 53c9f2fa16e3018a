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


# Python's int() refuses a literal of more digits (sys.get_int_max_str_digits); up to it a number
# parses, and the rule of its field refuses it by name (a cluster's nodes: 10**400)
NUMBER_CHARS = 4300


def read_text(path: Path, what: str, max_bytes: int) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes`` that the user named, through
    the one bounded reader (porting.untrusted); ``what`` names it in errors."""
    from porting import untrusted

    return untrusted.read_named_text(path, what, max_bytes)


def parse_yaml(text: str, source: str) -> object:
    """Parsed YAML by the one bounded parser (porting.untrusted: depth, expanded size, keys given
    twice), numbers left to their fields' rules."""
    from porting import untrusted

    return untrusted.parse_yaml(text, source, NUMBER_CHARS)


def parse_json(text: str, source: str) -> object:
    """Parsed JSON by the one bounded parser, as :func:`parse_yaml`."""
    from porting import untrusted

    return untrusted.parse_json(text, source, NUMBER_CHARS)
