"""A checkpoint as a command reads it, and atomic output directories.

A checkpoint written by ``porting import`` is one of our layouts (:mod:`porting.convert.layouts`:
NeMo 2, whose ``context/`` + ``weights/`` ``nemo.collections.llm`` loads, Megatron-LM or
Megatron-Bridge) plus our ``porting.json`` (:mod:`porting.convert.manifest`). A command opens its
checkpoint once, at its edge (:func:`open_checkpoint`: the layout found by :func:`locate`, the
manifest read), and hands the :class:`Checkpoint` down.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from porting.convert.layouts.base import Located
from porting.convert.layouts.registry import locate
from porting.convert.manifest import Manifest, check_manifest
from porting.errors import PortingError
from porting.guard import Terminated, raise_if_stopped, signals_deferred
from porting.untrusted import read_json

log = logging.getLogger(__name__)

# A tokenizer.json holds the whole vocabulary and merges: Gemma's is 34 MB.
MAX_TOKENIZER_JSON_BYTES = 256 << 20


@dataclass(frozen=True)
class Adopted:
    """A manifest the user's flags stand in for (a checkpoint trained elsewhere has none)."""

    manifest: Manifest
    tokenizer_dir: Path | None
    source: str  # what stands in for porting.json, for errors
    hf_config: Path | None = None  # the directory given as --hf-config, for a child process


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint as a command reads it: where its parts are (in which layout) and the manifest
    it is read by."""

    path: Path  # as the command was given it: the gate and child processes open it from this
    located: Located
    manifest: Manifest
    stand_in: Adopted | None = None  # what the manifest came from, where porting.json is not

    @property
    def family(self) -> str:
        """The name of the family the manifest records."""
        return self.manifest.family

    @property
    def dtype(self) -> str:
        """The weight dtype the manifest records (``"bfloat16"``)."""
        return self.manifest.dtype

    @property
    def source(self) -> str:
        """What the manifest was read from, for messages."""
        return self.stand_in.source if self.stand_in else str(self.located.manifest_path)


_ADOPTED: dict[Path, Adopted] = {}


@contextlib.contextmanager
def adopt(ckpt: str | os.PathLike, stand_in: Adopted):
    """For the block, read ``stand_in`` as the manifest (and tokenizer) of the checkpoint at
    ``ckpt``, which has none of its own. Nothing is written into it."""
    root = locate(ckpt).root.resolve()
    _ADOPTED[root] = stand_in
    try:
        yield
    finally:
        _ADOPTED.pop(root, None)


def adopted(ckpt: str | os.PathLike) -> Adopted | None:
    """The stand-in manifest registered for ``ckpt`` by :func:`adopt`, if any."""
    return _ADOPTED.get(locate(ckpt).root.resolve()) if _ADOPTED else None


def open_checkpoint(ckpt: Checkpoint | str | os.PathLike) -> Checkpoint:
    """The checkpoint at ``ckpt`` (its root, or one iteration directory) in any of our layouts,
    read by our ``porting.json`` or the manifest :func:`adopt` stands in for it; or say clearly
    why this is not one of ours. A :class:`Checkpoint` is returned as it is: the functions that
    take one still accept the path the gate hands them."""
    if isinstance(ckpt, Checkpoint):
        return ckpt
    path = Path(ckpt)
    loc = locate(path)
    stand_in = _ADOPTED.get(loc.root.resolve())
    if stand_in is not None:
        return Checkpoint(path, loc, stand_in.manifest, stand_in)
    manifest = loc.manifest_path
    if not os.path.lexists(manifest):
        if not loc.layout.adoptable:
            raise PortingError(
                f"{manifest}: missing; this checkpoint was not written by `porting import`, so "
                "the HF config and vocabulary padding needed for export are unknown"
            )
        raise PortingError(
            f"{manifest}: missing; this {loc.format} checkpoint was not written by `porting`: give "
            "the HF config.json of its architecture with --hf-config (and its tokenizer with "
            "--tokenizer)"
        )
    return Checkpoint(path, loc, check_manifest(read_json(manifest, loc.root), manifest))


def read_manifest(ckpt: str | os.PathLike) -> Manifest:
    """The manifest of the checkpoint at ``ckpt`` (:func:`open_checkpoint`), for a caller that
    needs nothing else of it."""
    return open_checkpoint(ckpt).manifest


def inside(base: str | os.PathLike, relative: str, what: str) -> Path:
    """``base / relative``, refused unless ``relative`` is a relative path that stays in ``base``.

    Symlinks are resolved first, so a link that leaves ``base`` is refused too.
    """
    base = Path(base).resolve()
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts or not relative:
        raise PortingError(f"{what} {relative!r} must be a relative path inside {base}")
    target = (base / rel).resolve()
    if not target.is_relative_to(base):
        raise PortingError(f"{what} {relative!r} leaves {base} (resolves to {target})")
    return target


def tokenizer_files(
    ckpt: Checkpoint | str | os.PathLike, manifest: Manifest | None = None
) -> list[Path]:
    """The tokenizer files ``manifest`` (default: the checkpoint's own) records: regular files in
    the checkpoint's own metadata directory (``context/``, or ``porting/`` in the Megatron
    layouts).

    A symlink, a subdirectory or a path that leaves that directory is refused, so a crafted
    manifest can neither read files elsewhere nor make export copy them; each JSON file must parse
    within :mod:`porting.untrusted`'s bounds before ``transformers`` reads it. A checkpoint
    adopted with a tokenizer directory (:func:`adopt`) gives that directory's files.
    """
    checkpoint = open_checkpoint(ckpt)
    if checkpoint.stand_in is not None:
        tok_dir = checkpoint.stand_in.tokenizer_dir
        return _regular_files(tok_dir) if tok_dir else []
    manifest = checkpoint.manifest if manifest is None else manifest
    if not manifest.tokenizer:
        return []
    loc = checkpoint.located
    where = f"{loc.manifest_path}: tokenizer path"
    tok_dir = inside(loc.root, manifest.tokenizer["path"], where)
    if not tok_dir.is_relative_to(loc.meta.resolve()) or not tok_dir.is_dir():
        raise PortingError(
            f"{where} {manifest.tokenizer['path']!r} is not a directory in {loc.meta.name}/"
        )
    files = _regular_files(tok_dir)
    for f in files:
        if f.suffix == ".json":
            read_json(f, loc.root, max_bytes=MAX_TOKENIZER_JSON_BYTES)
    return files


def _regular_files(tok_dir: Path) -> list[Path]:
    if not tok_dir.is_dir():
        raise PortingError(f"{tok_dir}: not a tokenizer directory")
    files = []
    for f in sorted(tok_dir.iterdir()):
        if f.is_symlink() or not f.is_file():
            raise PortingError(f"{f}: the tokenizer directory may hold only regular files")
        files.append(f)
    return files


def extra_file(checkpoint: Checkpoint, name: str) -> Path:
    """The HF extra file ``name`` (``generation_config.json``) kept in the checkpoint, a JSON
    object within :mod:`porting.untrusted`'s bounds."""
    loc = checkpoint.located
    path = loc.meta / "hf_extra" / name
    if not isinstance(read_json(path, loc.root), dict):
        raise PortingError(f"{path}: not a JSON object")
    return path


def prepare_output(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing output unless ``overwrite``; return it as a Path (not created)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise PortingError(f"{out} exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def claimed_output(out: str | os.PathLike, overwrite: bool, what: str):
    """Own ``out`` for the block and yield a temporary directory that becomes it on success.

    Holds ``out``'s lock (:func:`porting.guard.output_lock`: a second run fails at once), refuses
    an existing ``out`` without ``overwrite``, and removes what a killed earlier run left beside
    it (:func:`remove_stale`; nobody else can be writing it while the lock is held).
    """
    from porting.guard import output_lock

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, what):
        prepare_output(out, overwrite)
        remove_stale(out)
        with atomic_dir(out) as tmp:
            yield tmp


# What a run writing OUT keeps beside it while it works, each named ``.OUT.KIND-SUFFIX``: the
# output being written (``partial``, atomic_dir), the one being replaced (``old``), and convert's
# HF copy between its two steps (``hf``, porting.api.convert).
STAGING_KINDS = ("partial", "old", "hf")


def staging_path(out: str | os.PathLike, kind: str) -> Path:
    """A new ``.OUT.KIND-XXXXXXXXXXXXXXXX`` beside ``out``, not yet created: a caller that names it
    before making it can remove it on every exit path, however early a signal comes."""
    if kind not in STAGING_KINDS:
        raise ValueError(f"staging kind {kind!r}: one of {', '.join(STAGING_KINDS)}")
    out = Path(out)
    return out.with_name(f".{out.name}.{kind}-{secrets.token_hex(8)}")


# Staging directories of this process's runs in progress (staged()): convert's HF copy stays
# while its import step, under the same lock, clears what earlier runs left.
_LIVE: set[Path] = set()


@contextlib.contextmanager
def staged(out: str | os.PathLike, kind: str, mode: int = 0o700):
    """A new staging directory of ``out`` (``kind``: one of :data:`STAGING_KINDS`) for the block,
    removed however the block ends; a signal during the removal waits for it to finish."""
    path = staging_path(out, kind)
    _LIVE.add(path.absolute())
    try:
        path.mkdir(mode=mode)
        yield path
    finally:
        with signals_deferred():
            shutil.rmtree(path, ignore_errors=True)
        _LIVE.discard(path.absolute())


def remove_stale(out: str | os.PathLike) -> None:
    """Remove every staging entry of ``out`` (:data:`STAGING_KINDS`) that a killed earlier run
    left. Only with ``out``'s lock held: a live run on ``out`` would hold it, so none is its but
    this process's own (:func:`staged`)."""
    out = Path(out)
    # The suffix has no dot or dash: the staging of an output named "OUT.partial-x" is not OUT's.
    mine = re.compile(rf"\.{re.escape(out.name)}\.(?:{'|'.join(STAGING_KINDS)})-[a-z0-9_]+")
    try:
        entries = [
            e for e in out.parent.iterdir() if mine.fullmatch(e.name) and e.absolute() not in _LIVE
        ]
    except FileNotFoundError:
        return
    for entry in entries:
        log.warning("removing %s, left by an earlier run that did not finish", entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


# Below this much free space a failed write is taken for a full disk: writers that lose the
# errno on the way up (torch.save's zip writer reports "unexpected pos 704 vs 598") still fail
# because a write came up short.
_NEARLY_FULL = 4 << 20


def disk_full_error(
    err: BaseException, path: str | os.PathLike, name: str | os.PathLike | None = None
) -> OSError | None:
    """An ``OSError(ENOSPC)`` naming ``name`` (default ``path``) when ``err`` came from a full disk: ENOSPC or EDQUOT
    anywhere in its chain (causes, contexts, torch's per-rank checkpoint failures), or any error
    but ours while ``path``'s file system has less than 4 MiB free. None otherwise."""
    name = str(path if name is None else name)
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return OSError(e.errno, os.strerror(e.errno), name)
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint CheckpointException
        if isinstance(failures, dict):
            todo += [x for x in failures.values() if isinstance(x, BaseException)]
    # torch's CheckpointException is a BaseException; a stop or an exit is not a write failure.
    stops = (PortingError, KeyboardInterrupt, SystemExit, GeneratorExit, Terminated)
    if not isinstance(err, stops):
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        if st.f_bavail * st.f_frsize < _NEARLY_FULL:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
    return None


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike):
    """Yield a temporary sibling directory that becomes ``out`` only if the block succeeds.

    On any error or signal the temporary directory is removed, so a failed run never leaves
    something that looks like a complete output under the final name. An existing ``out`` is
    replaced only at the very end, by renames that a signal does not cut in half; a signal that
    arrived before them stops the replacement even where library code dropped its exception.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_path(out, "partial")
    try:
        tmp.mkdir()  # with the user's umask, as any finished output
        yield tmp
        raise_if_stopped()
        with signals_deferred():
            _put_in_place(tmp, out)
    except BaseException as err:
        # Judged before the partial output is removed: its bytes are what filled the disk.
        full = disk_full_error(err, tmp, out)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from err
        raise


def _put_in_place(tmp: Path, out: Path) -> None:
    if out.exists() or out.is_symlink():
        old = staging_path(out, "old")
        out.rename(old)
        tmp.rename(out)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        tmp.rename(out)
