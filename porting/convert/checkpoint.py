"""Where a checkpoint's parts are, our additions to it, and atomic output directories.

A checkpoint written by ``porting import`` is a plain NeMo 2.0 checkpoint (``context/`` +
``weights/``) that ``nemo.collections.llm`` loads, or a Megatron-LM / Megatron-Bridge one
(:mod:`porting.convert.layouts`), plus our ``porting.json``: the family, the original HF
``config.json``, the vocabulary padding, the weight dtype and where the tokenizer lives. With it,
export needs no HF model and no hub. :func:`locate` finds which layout a directory holds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from porting.convert.untrusted import checkpoint_dir, read_int, read_json
from porting.errors import PortingError
from porting.guard import Terminated, raise_if_stopped, signals_deferred

log = logging.getLogger(__name__)

MANIFEST = "porting.json"
FORMAT = "porting-nemo2"
VERSION = 1
# HF files other than weights, config and tokenizer that export should hand back unchanged.
EXTRA_HF_FILES = ("generation_config.json",)

FORMATS = ("nemo2", "megatron-lm", "megatron-bridge")
TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"
OURS = "porting"  # our directory in the Megatron layouts
_ITER = re.compile(r"iter_(\d{7,})")
_PREFIX = {"nemo2": "module.", "megatron-lm": "", "megatron-bridge": ""}
# A tokenizer.json holds the whole vocabulary and merges: Gemma's is 34 MB.
MAX_TOKENIZER_JSON_BYTES = 256 << 20


@dataclass(frozen=True)
class Located:
    """Where one checkpoint's parts are."""

    format: str
    root: Path
    weights: Path  # the torch_dist directory
    prefix: str  # of every model tensor key in it
    meta: Path  # our porting.json, tokenizer/ and hf_extra/ (context/ for NeMo 2)
    iteration: int | None = None

    @property
    def manifest_path(self) -> Path:
        """Where ``porting.json`` is (or would be)."""
        return self.meta / "porting.json"


def _tracked_iteration(root: Path) -> tuple[int | None, Path]:
    """The iteration directory ``latest_checkpointed_iteration.txt`` names, checked to be one."""
    tracked = read_int(root / TRACKER, root, "an iteration number", ("release",))
    if tracked == "release":
        return None, root / "release"
    return tracked, root / f"iter_{tracked:07d}"


def locate(ckpt: str | os.PathLike, fmt: str | None = None) -> Located:
    """Find the layout of the checkpoint at ``ckpt`` (its root, or one iteration directory).

    ``fmt`` (one of :data:`FORMATS`) is checked against what the directory holds; a mismatch is
    an error that names both, never a guess.
    """
    path = Path(ckpt)
    if fmt is not None and fmt not in FORMATS:
        raise PortingError(f"unknown checkpoint format {fmt!r}; one of {', '.join(FORMATS)}")
    if not path.is_dir():
        raise PortingError(f"{path}: not a directory")
    iteration: int | None
    if os.path.lexists(path / "weights") and os.path.lexists(path / "context"):
        weights, context = (
            checkpoint_dir(path / "weights", path),
            checkpoint_dir(path / "context", path),
        )
        found = Located("nemo2", path, weights, "module.", context)
    else:
        if os.path.lexists(path / TRACKER):
            iteration, weights = _tracked_iteration(path)
            root = path
        elif (path / ".metadata").is_file() and (
            _ITER.fullmatch(path.name) or path.name == "release"
        ):
            m = _ITER.fullmatch(path.name)
            iteration, weights, root = (int(m.group(1)) if m else None), path, path.parent
        else:
            raise PortingError(
                f"{path}: not a checkpoint we know: a NeMo 2 checkpoint has context/ and weights/, "
                f"a Megatron-LM one {TRACKER} and iter_NNNNNNN/, a Megatron-Bridge one also "
                f"{RUN_CONFIG} in its iteration"
            )
        if not os.path.lexists(weights):
            raise PortingError(f"{weights}: the iteration the checkpoint names is missing")
        checkpoint_dir(weights, root)
        # A run_config.yaml that is a link still makes the layout Bridge's, so that it is refused
        # when read rather than skipped.
        kind = "megatron-bridge" if os.path.lexists(weights / RUN_CONFIG) else "megatron-lm"
        if os.path.lexists(root / OURS):
            checkpoint_dir(root / OURS, root)
        found = Located(kind, root, weights, _PREFIX[kind], root / OURS, iteration)
    if fmt is not None and fmt != found.format:
        raise PortingError(f"{path}: a {found.format} checkpoint, not {fmt}")
    return found


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


def write_manifest(
    ckpt: str | os.PathLike, manifest: Manifest, meta: str | os.PathLike | None = None
) -> None:
    """Write ``porting.json`` (atomically) into ``meta``: by default the NeMo 2 ``context/``."""
    path = Path(meta if meta is not None else context_dir(ckpt)) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    tmp.replace(path)


_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _check_manifest(data, path: Path) -> Manifest:
    """A :class:`Manifest` from parsed JSON, every field checked (the file may be hostile)."""

    def bad(field_name: str, why: str) -> PortingError:
        return PortingError(f"{path}: field {field_name!r} {why}")

    if not isinstance(data, dict):
        raise PortingError(f"{path}: not a JSON object")
    if data.get("format") != FORMAT:
        raise PortingError(f"{path}: unknown format {data.get('format')!r}")
    known = set(Manifest.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise PortingError(f"{path}: unknown field(s) {', '.join(unknown)}")
    for name in ("family", "hf_architecture", "dtype"):
        if not isinstance(data.get(name), str):
            raise bad(name, "must be a string")
    if not isinstance(data.get("hf_config"), dict):
        raise bad("hf_config", "must be an object")
    for name in ("vocab_size", "padded_vocab_size", "version"):
        v = data.get(name)
        if type(v) is not int or v <= 0:
            raise bad(name, f"must be a positive integer, not {v!r}")
    if data["version"] > VERSION:
        raise bad("version", f"is {data['version']}; this porting reads up to {VERSION}")
    if data["padded_vocab_size"] < data["vocab_size"]:
        raise bad("padded_vocab_size", "is smaller than vocab_size")
    if data["dtype"] not in _DTYPE_NAMES:
        raise bad("dtype", f"must be one of {', '.join(_DTYPE_NAMES)}, not {data['dtype']!r}")
    tok = data.get("tokenizer", {})
    if not isinstance(tok, dict) or set(tok) - {"kind", "path"}:
        raise bad("tokenizer", "must be an object with 'kind' and 'path'")
    if tok and (tok.get("kind") != "hf" or not isinstance(tok.get("path"), str)):
        raise bad("tokenizer", f"must be {{'kind': 'hf', 'path': DIR}}, not {tok!r}")
    extras = data.get("extra_files", [])
    if not isinstance(extras, list) or any(e not in EXTRA_HF_FILES for e in extras):
        raise bad("extra_files", f"may only list {', '.join(EXTRA_HF_FILES)}, not {extras!r}")
    return Manifest(**data)


@dataclass(frozen=True)
class Adopted:
    """A manifest the user's flags stand in for (a checkpoint trained elsewhere has none)."""

    manifest: Manifest
    tokenizer_dir: Path | None
    source: str  # what stands in for porting.json, for errors
    hf_config: Path | None = None  # the directory given as --hf-config, for a child process


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


def read_manifest(ckpt: str | os.PathLike) -> Manifest:
    """Read and check our ``porting.json`` of a checkpoint in any of our layouts, or say clearly
    why this is not one of ours."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise PortingError(f"{ckpt}: not a directory")
    loc = locate(ckpt)
    stand_in = adopted(ckpt)
    if stand_in is not None:
        return stand_in.manifest
    path = loc.manifest_path
    if not os.path.lexists(path):
        if loc.format == "nemo2":
            raise PortingError(
                f"{path}: missing; this checkpoint was not written by `porting import`, so the "
                "HF config and vocabulary padding needed for export are unknown"
            )
        raise PortingError(
            f"{path}: missing; this {loc.format} checkpoint was not written by `porting`: give the "
            "HF config.json of its architecture with --hf-config (and its tokenizer with "
            "--tokenizer)"
        )
    return _check_manifest(read_json(path, loc.root), path)


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


def tokenizer_files(ckpt: str | os.PathLike, manifest: Manifest) -> list[Path]:
    """The tokenizer files recorded in the manifest: regular files in the checkpoint's own
    metadata directory (``context/``, or ``porting/`` in the Megatron layouts).

    A symlink, a subdirectory or a path that leaves that directory is refused, so a crafted
    manifest can neither read files elsewhere nor make export copy them; each JSON file must parse
    within :mod:`porting.convert.untrusted`'s bounds before ``transformers`` reads it. A checkpoint
    adopted with a tokenizer directory (:func:`adopt`) gives that directory's files.
    """
    stand_in = adopted(ckpt)
    if stand_in is not None:
        return _regular_files(stand_in.tokenizer_dir) if stand_in.tokenizer_dir else []
    if not manifest.tokenizer:
        return []
    loc = locate(ckpt)
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


def extra_file(ckpt: str | os.PathLike, name: str) -> Path:
    """The HF extra file ``name`` (``generation_config.json``) kept in the checkpoint, a JSON
    object within :mod:`porting.convert.untrusted`'s bounds."""
    loc = locate(ckpt)
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
# HF copy between its two steps (``hf``, porting.convert.api.convert).
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
