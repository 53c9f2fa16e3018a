"""Our additions to a NeMo 2.0 checkpoint directory, and atomic output directories.

A checkpoint written by ``porting import`` is a plain NeMo 2.0 checkpoint (``context/`` +
``weights/``) that ``nemo.collections.llm`` loads, plus ``context/porting.json``: the family, the
original HF ``config.json``, the vocabulary padding, the weight dtype and where the tokenizer lives.
With it, export needs no HF model and no hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from porting.errors import PortingError

MANIFEST = "porting.json"
FORMAT = "porting-nemo2"
VERSION = 1
# HF files other than weights, config and tokenizer that export should hand back unchanged.
EXTRA_HF_FILES = ("generation_config.json",)


@dataclass
class Manifest:
    """What ``context/porting.json`` records."""

    family: str
    hf_architecture: str
    hf_config: dict
    vocab_size: int
    padded_vocab_size: int
    dtype: str
    tokenizer: dict = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)
    format: str = FORMAT
    version: int = VERSION


def context_dir(ckpt: str | os.PathLike) -> Path:
    """The ``context/`` directory of a NeMo 2.0 checkpoint."""
    return Path(ckpt) / "context"


def write_manifest(ckpt: str | os.PathLike, manifest: Manifest) -> None:
    """Write ``context/porting.json`` (atomically)."""
    path = context_dir(ckpt) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def read_manifest(ckpt: str | os.PathLike) -> Manifest:
    """Read ``context/porting.json``, or say clearly why this is not one of our checkpoints."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise PortingError(f"{ckpt}: not a directory")
    if not (ckpt / "weights").is_dir() or not context_dir(ckpt).is_dir():
        raise PortingError(f"{ckpt}: not a NeMo 2.0 checkpoint (needs context/ and weights/)")
    path = context_dir(ckpt) / MANIFEST
    if not path.exists():
        raise PortingError(
            f"{path}: missing; this checkpoint was not written by `porting import`, so the HF "
            "config and vocabulary padding needed for export are unknown"
        )
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise PortingError(f"{path}: unknown format {data.get('format')!r}")
        return Manifest(**data)
    except (json.JSONDecodeError, TypeError) as err:
        raise PortingError(f"{path}: corrupt manifest ({err})") from err


def prepare_output(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing output unless ``overwrite``; return it as a Path (not created)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise PortingError(f"{out} exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike):
    """Yield a temporary sibling directory that becomes ``out`` only if the block succeeds.

    On any error the temporary directory is removed, so a failed run never leaves something that
    looks like a complete output under the final name. An existing ``out`` is replaced only at the
    very end.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
