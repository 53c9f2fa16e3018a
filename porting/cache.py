"""Where porting keeps what it measured or decided once and reuses: the gate's matmul rate
(:mod:`porting.parity.floor`) and the tokenizer records of data prep (:mod:`data_prep.tokenizer`).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$PORTING_CACHE_DIR`` where set (the tests set their own), else
    ``$XDG_CACHE_HOME/porting``, else ``~/.cache/porting`` (the XDG base-directory convention)."""
    own = os.environ.get("PORTING_CACHE_DIR")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "porting"
