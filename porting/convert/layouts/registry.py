"""The checkpoint layouts porting reads and writes, one registration each, and finding which one a
directory holds (:func:`locate`).

A new layout is a module implementing :class:`~porting.convert.layouts.base.Layout` and a line in
:data:`LAYOUTS`; ``--format``'s choices, the error naming every layout and the commands follow.
"""

from __future__ import annotations

import os
from pathlib import Path

from porting.convert.layouts.base import Layout, Located
from porting.convert.layouts.megatron_bridge import MEGATRON_BRIDGE
from porting.convert.layouts.megatron_lm import MEGATRON_LM
from porting.convert.layouts.nemo2 import NEMO2
from porting.errors import PortingError

# In the order --format lists them; NeMo 2, `porting import`'s default, first.
LAYOUTS: tuple[Layout, ...] = (NEMO2, MEGATRON_LM, MEGATRON_BRIDGE)
NAMES = tuple(layout.name for layout in LAYOUTS)


def layout_named(name: str) -> Layout:
    """The layout whose ``--format`` name is ``name``."""
    for layout in LAYOUTS:
        if layout.name == name:
            return layout
    raise PortingError(f"unknown checkpoint format {name!r}; one of {', '.join(NAMES)}")


def locate(ckpt: str | os.PathLike, fmt: str | None = None) -> Located:
    """Find the layout of the checkpoint at ``ckpt`` (its root, or a part a layout accepts in its
    place: one iteration directory).

    ``fmt`` (one of :data:`NAMES`) is checked against what the directory holds; a mismatch is an
    error that names both, never a guess.
    """
    path = Path(ckpt)
    wanted = None if fmt is None else layout_named(fmt)
    if not path.is_dir():
        raise PortingError(f"{path}: not a directory")
    found = next(filter(None, (layout.find(path) for layout in LAYOUTS)), None)
    if found is None:
        raise PortingError(
            f"{path}: not a checkpoint we know: " + ", ".join(layout.looks for layout in LAYOUTS)
        )
    if wanted is not None and found.layout is not wanted:
        raise PortingError(f"{path}: a {found.format} checkpoint, not {wanted.name}")
    return found


def is_hf_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an HF model directory rather than a checkpoint in one of the layouts."""
    path = Path(path)
    return (path / "config.json").is_file() and not any(layout.marks(path) for layout in LAYOUTS)
