"""NeMo 2's layout: ``<root>/weights/`` (keys ``module.decoder...``: NeMo's ``MegatronParallel``
wrapper, ``nemo/lightning/megatron_parallel.py``) and ``<root>/context/`` (NeMo's ``io.json``, our
``porting.json``, the tokenizer and HF extras).

The streamed writer (:mod:`porting.convert.streaming_save`, through NeMo's save) writes this
layout; the others are made from it.
"""

from __future__ import annotations

import os
from pathlib import Path

from porting.convert.layouts.base import Located
from porting.convert.manifest import Manifest
from porting.untrusted import checkpoint_dir


class NeMo2:
    """``--format nemo2``."""

    name = "nemo2"
    title = "NeMo 2"
    prefix = "module."
    # The gate and export rebuild the model from porting.json, never from io.json (which runs
    # code): a NeMo 2 checkpoint without our manifest has nothing safe to be read by.
    adoptable = False
    looks = "a NeMo 2 checkpoint has context/ and weights/"

    def marks(self, path: Path) -> bool:
        return (path / "weights").is_dir()

    def root_of(self, path: Path) -> Path | None:
        return None

    def find(self, path: Path) -> Located | None:
        if not (os.path.lexists(path / "weights") and os.path.lexists(path / "context")):
            return None
        weights = checkpoint_dir(path / "weights", path)
        return Located(self, path, weights, checkpoint_dir(path / "context", path))

    def check_saved(self, loc: Located, family=None) -> None:
        from porting.convert.context import check_io_json

        check_io_json(loc.root, family)

    def saved_config(self, loc: Located, family=None) -> tuple[dict, str]:
        # NeMo's io.json describes the model as objects to import and call
        # (porting.convert.context); the tensors' shapes are checked against the manifest instead.
        return {}, str(loc.meta / "io.json")

    def check_config(self, config, family) -> None:
        """Every family's model: NeMo 2's io.json names the family's own classes."""

    def write(self, out: Path, config, manifest: Manifest, family) -> None:
        """Nothing to do: the streamed writer's output is this layout."""


NEMO2 = NeMo2()
