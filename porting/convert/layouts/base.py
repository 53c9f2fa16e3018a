"""What a checkpoint layout is: the :class:`Layout` protocol each one implements, and
:class:`Located`, where one checkpoint's parts lie.

Every layout keeps the model in the same ``torch_dist`` format (``.metadata`` + ``*.distcp``); a
layout says where that directory is, the prefix of its keys, the owner's metadata beside it and
where our own files go. :mod:`porting.convert.layouts.registry` lists the layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from porting.convert.manifest import MANIFEST, Manifest


@dataclass(frozen=True)
class Located:
    """Where one checkpoint's parts are, and the layout that says so."""

    layout: Layout
    root: Path
    weights: Path  # the torch_dist directory
    meta: Path  # our porting.json, tokenizer/ and hf_extra/ (context/ for NeMo 2)
    iteration: int | None = None

    @property
    def format(self) -> str:
        """The layout's ``--format`` name."""
        return self.layout.name

    @property
    def prefix(self) -> str:
        """Of every model tensor key in :attr:`weights`."""
        return self.layout.prefix

    @property
    def manifest_path(self) -> Path:
        """Where ``porting.json`` is (or would be)."""
        return self.meta / MANIFEST


class Layout(Protocol):
    """One checkpoint layout: found in a directory, its saved configuration read, written from the
    NeMo 2 checkpoint the streamed writer makes, and checked against a family."""

    name: str  # the --format value (docs/formats.md)
    title: str  # in messages: "a NeMo 2 checkpoint"
    prefix: str  # of every model tensor key in its torch_dist directory
    # Whether a checkpoint of this layout trained elsewhere can be read with the user's HF config
    # standing in for our manifest (porting.convert.foreign).
    adoptable: bool
    # How a directory of this layout looks, a clause of the error naming every layout.
    looks: str

    def marks(self, path: Path) -> bool:
        """Whether ``path`` carries this layout's mark, from names alone (an HF directory never
        does)."""
        ...

    def root_of(self, path: Path) -> Path | None:
        """The checkpoint root, where ``path`` is a part of one that this layout accepts in its
        place (a Megatron iteration directory), from names alone; else None."""
        ...

    def find(self, path: Path) -> Located | None:
        """Where the parts of the checkpoint at ``path`` are, if it is one of this layout (each of
        its directories checked to be one of the checkpoint's); None if it is not."""
        ...

    def check_saved(self, loc: Located, family=None) -> None:
        """Refuse the owner's metadata of the checkpoint at ``loc`` where loading it would run
        code (``family``: the checkpoint's, whose declared symbols are allowed)."""
        ...

    def saved_config(self, loc: Located, family=None) -> tuple[dict, str]:
        """The model's architecture as the checkpoint saved it for its owner, and the file that
        says it (for messages); ``family``: the checkpoint's, whose declared symbols the file may
        name."""
        ...

    def check_config(self, config, family) -> None:
        """Refuse, before any tensor is converted, a model this layout cannot describe
        (``config``: the family's Megatron config of the HF config being imported)."""
        ...

    def write(self, out: Path, config, manifest: Manifest, family) -> None:
        """Turn the NeMo 2 checkpoint the streamed writer made at ``out`` (``manifest`` in its
        ``context/``) into this layout, in place; ``config``: the family's Megatron config of it."""
        ...
