"""Reading any region of a tensor from a Megatron ``torch_dist`` checkpoint, one chunk at a time.

Megatron's ``dist_checkpointing.load`` cannot read part of a stacked layer key in a single process:
it wraps every request in a torch ``ShardedTensor`` whose metadata must place every fragment on
some rank, and with one rank the fragments it did not ask for land on rank 0 too
(``megatron/core/dist_checkpointing/strategies/torch.py``, ``sharded_tensor_to_torch_sharded_tensor``).
The format itself allows it: torch's ``.metadata`` lists each stored chunk of each key (offsets and
sizes) and where its bytes are (file, offset, length), and each chunk is one ``torch.save`` record
(``torch/distributed/checkpoint/filesystem.py``: ``FileSystemWriter`` writes it, ``FileSystemReader
.read_data`` reads it back with ``torch.load(weights_only=True)``). :class:`DistCheckpointReader`
reads exactly the chunks that overlap a requested region, with torch's own metadata reader and
torch's own weights-only unpickler, each record's bytes mapped rather than copied
(:func:`_mapped_record`); nothing else is held.
"""

from __future__ import annotations

import functools
import io
import math
import mmap
import os
import pickle
import struct
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch

from porting import pages
from porting.errors import PortingError
from porting.untrusted import open_file, read_bytes, read_json, regular_file, shown

# A 405B model's .metadata with its optimizer state, saved by a thousand ranks, is some 100 MB.
MAX_METADATA_BYTES = 1 << 30
# Megatron's deepest tensors: (layers, experts, rows, columns), with room for prepended axes.
MAX_RANK = 16


class _Window(io.RawIOBase):
    """``[offset, offset + length)`` of an open file, as a file of its own (for ``zipfile``)."""

    def __init__(self, f, offset: int, length: int) -> None:
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._length - self._pos))
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got
        return got


def _mapped_record(path: Path, offset: int, length: int, weights: Path) -> torch.Tensor:
    """The tensor of the ``torch.save`` record at ``[offset, offset + length)`` of ``path``, as a
    view of the mapped file (registered: its pages are released as they are copied,
    :mod:`porting.pages`).

    What ``torch.load(weights_only=True)`` does, without its copies: the record is a zip of
    stored (uncompressed) members; its pickle is read by torch's own weights-only unpickler, and
    each storage it names becomes a view of that member's bytes in a private mapping of the file
    instead of a fresh buffer (``torch/serialization.py``, ``_load``). A torch_dist layer is read
    at the speed of the page cache, not of two copies and a page fault per 4 KiB.
    """
    from torch import _weights_only_unpickler

    with open_file(path, weights) as f:
        with zipfile.ZipFile(_Window(f, offset, length)) as zf:
            for member in zf.infolist():
                # torch.save stores every member as is; a compressed one could inflate a small
                # record into any size when read
                if member.compress_type != zipfile.ZIP_STORED or member.file_size > length:
                    raise ValueError(f"{member.filename} is compressed or larger than its record")
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise ValueError(f"{len(pkl)} pickles in the record")
            prefix = pkl[0][: -len("data.pkl")]
            order = f"{prefix}byteorder"
            if order in zf.namelist() and zf.read(order).decode() != sys.byteorder:
                raise ValueError("stored with the other byte order")
            pickled = zf.read(pkl[0])
            members = {}
            for member in zf.infolist():
                if not member.filename.startswith(f"{prefix}data/"):
                    continue
                f.seek(offset + member.header_offset)
                local = f.read(30)
                if len(local) != 30 or local[:4] != b"PK\x03\x04":
                    raise ValueError(f"{member.filename}: no local header")
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                start = offset + member.header_offset + 30 + name_len + extra_len
                members[member.filename[len(prefix) + 5 :]] = (start, member.file_size)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes reach no file
    pages.register(mapped)

    def storage(saved_id):
        typename, storage_type, key, _location, numel = saved_id
        if torch.serialization._maybe_decode_ascii(typename) != "storage":
            raise pickle.UnpicklingError(f"persistent id {typename!r}")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        start, size = members[torch.serialization._maybe_decode_ascii(key)]
        nbytes = numel * torch._utils._element_size(dtype)
        if nbytes > size or start + nbytes > offset + length:
            raise ValueError(f"storage {key!r} of {nbytes} bytes exceeds its member ({size})")
        raw = (
            torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=start)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        return torch.storage.TypedStorage(
            wrap_storage=raw.untyped_storage(), dtype=dtype, _internal=True
        )

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = storage
    tensor = unpickler.load()
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"holds a {type(tensor).__name__}, not a tensor")
    return tensor


def _metadata_globals() -> dict[tuple[str, str], object]:
    """The classes a ``.metadata`` may name: torch's checkpoint metadata and Megatron's two
    subclasses of it, each a plain data holder (``torch/distributed/checkpoint/{metadata,planner,
    filesystem}.py``, ``megatron/core/dist_checkpointing/strategies/torch.py``)."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed: dict[tuple[str, str], object] = {("torch", "Size"): torch.Size}
    for module, names in (
        (
            metadata,
            (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "MetadataIndex",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            ),
        ),
        (planner, ("WriteItem", "WriteItemType", "TensorWriteData", "SavePlan")),
        (filesystem, ("_StorageInfo",)),
    ):
        for name in names:
            if hasattr(module, name):
                allowed[(module.__name__, name)] = getattr(module, name)
    # Megatron-Core up to 0.15 (NeMo 2.7.3's) saved its own subclasses of these two; from 0.16
    # its classes of those names are empty placeholders that derive from nothing, so a NeMo 2
    # checkpoint read on the current stack unpickled into a class that is no Metadata. There,
    # stand-ins that are the subclasses the writer had (the loaded object only carries fields).
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    for name, base in (("MCoreMetadata", metadata.Metadata), ("MCoreSavePlan", planner.SavePlan)):
        real = getattr(mcore_torch, name, None)
        usable = isinstance(real, type) and issubclass(real, base)
        allowed[(mcore_torch.__name__, name)] = real if usable else _stand_in(name, base)
    return allowed


def writable(md):
    """``md`` as it may be pickled again for other tools to read: a stand-in of
    :func:`_metadata_globals` (a Megatron-Core <= 0.15 save read where Megatron-Core has no such
    class) becomes torch's own ``Metadata``, which every Megatron-Core loads; its ``mcore_data``
    (the flattened-range records those versions kept) is left behind with the class."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import Metadata

    if type(md).__module__ != __name__:
        return md
    return Metadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(Metadata)})


@functools.cache
def _stand_in(name: str, base: type) -> type:
    return type(name, (base,), {"__module__": __name__})


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle`` for a ``.metadata`` file, with every global checked against an allow-list.

    torch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a crafted
    ``.metadata`` would run whatever it names. Here it may name only the checkpoint's own data
    classes, torch dtypes and layouts; anything else is refused by its name before it is looked up.
    """

    def __init__(self, f) -> None:
        super().__init__(f)
        self._allowed = _metadata_globals()

    def find_class(self, module: str, name: str):
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a .metadata file")


def read_metadata(weights: str | Path):
    """torch's ``Metadata`` of the ``torch_dist`` directory ``weights``, unpickled with only the
    checkpoint's own data classes allowed (nothing in it can run code), every tensor it records
    checked against the bytes stored for it (:func:`_check_records`) before anyone sizes a buffer
    by it, and Megatron's ``metadata.json`` beside it, where there is one, naming this format."""
    weights = Path(weights)
    path = weights / ".metadata"
    if not os.path.lexists(path):
        raise PortingError(f"{path}: missing; not a torch_dist checkpoint")
    raw = read_bytes(path, weights, MAX_METADATA_BYTES)
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as err:  # pickle raises many types for a corrupt file
        raise PortingError(f"{path}: unreadable ({type(err).__name__}: {err})") from err
    from torch.distributed.checkpoint.metadata import Metadata

    if (
        not isinstance(md, Metadata)
        or not isinstance(md.state_dict_metadata, dict)
        or not isinstance(md.storage_data, dict)
    ):
        raise PortingError(f"{path}: holds a {type(md).__name__}, not torch checkpoint metadata")
    _check_records(md, weights, path)
    backend = weights / "metadata.json"
    if os.path.lexists(backend):
        # Megatron-Core's dist_checkpointing writes it and picks its loader by it.
        info = read_json(backend, weights)
        if not isinstance(info, dict) or info.get("sharded_backend", "torch_dist") != "torch_dist":
            raise PortingError(
                f"{backend}: not a torch_dist checkpoint's (sharded_backend "
                f"{shown(info.get('sharded_backend') if isinstance(info, dict) else info)})"
            )
    return md


def _dims(value, what: str, path: Path) -> tuple[int, ...]:
    ok = isinstance(value, tuple | list) and len(value) <= MAX_RANK
    if not ok or not all(type(d) is int and 0 <= d < 2**63 for d in value):
        raise PortingError(
            f"{path}: {what} is {shown(value)}; a shape is at most {MAX_RANK} integers >= 0"
        )
    return tuple(value)


def _record(weights: Path, info, key: str, path: Path, sizes: dict[str, int]) -> None:
    """``info`` (a record's place) names a regular file of ``weights`` that holds its bytes."""
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise PortingError(f"{path}: {key!r} is stored in {shown(name)}, not a file of {weights}")
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
        raise PortingError(
            f"{path}: {key!r} is stored at offset {shown(offset)}, length {shown(length)}"
        )
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:  # torch's stream extensions (zstd): the record is no torch.save zip
        raise PortingError(f"{path}: {key!r} is stored through {shown(transforms)}; not read here")
    if name not in sizes:
        sizes[name] = regular_file(weights / name, weights).stat().st_size
    if offset + length > sizes[name]:
        raise PortingError(
            f"{weights / name}: truncated; {key!r} needs bytes {offset}..{offset + length}, the "
            f"file has {sizes[name]}"
        )


def _check_records(md, weights: Path, path: Path) -> None:
    """Every tensor ``md`` records is one the stored bytes can hold, so that no shape read from it
    can size an allocation beyond the checkpoint's own size: its shape and every chunk's are
    non-negative integers of one rank, the chunks lie inside the tensor and add up to it (as
    torch's planner saves them, ``_validate_global_plan``), and each chunk's record, a file of
    ``weights`` at least as long as the chunk's bytes, exists. Every record is checked the same way
    (the ``common_state`` one included): a plain file name of ``weights``, inside it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    sizes: dict[str, int] = {}
    for idx, info in md.storage_data.items():
        fqn = getattr(idx, "fqn", None)
        if not isinstance(fqn, str):
            raise PortingError(f"{path}: a record is named {shown(fqn)}, not a tensor name")
        _record(weights, info, fqn, path, sizes)
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise PortingError(f"{path}: a tensor is named {shown(key)}, not a string")
        if not hasattr(meta, "chunks"):
            continue  # bytes (a ShardedObject, the common state): read as their record's length
        shape = _dims(getattr(meta, "size", None), f"the shape of {key!r}", path)
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise PortingError(f"{path}: {key!r} has dtype {shown(dtype)}, not a torch dtype")
        if not isinstance(meta.chunks, list):
            raise PortingError(f"{path}: {key!r} lists its chunks as {type(meta.chunks).__name__}")
        volume = 0
        for chunk in meta.chunks:
            where = f"a chunk of {key!r} {shape}"
            offsets = _dims(getattr(chunk, "offsets", None), f"{where}: its offsets", path)
            sizes_ = _dims(getattr(chunk, "sizes", None), f"{where}: its shape", path)
            if len(offsets) != len(shape) or len(sizes_) != len(shape):
                raise PortingError(
                    f"{path}: {where} is at {offsets} of shape {sizes_}, not of rank {len(shape)}"
                )
            if any(o + n > d for o, n, d in zip(offsets, sizes_, shape, strict=True)):
                raise PortingError(
                    f"{path}: {where} at {offsets} of shape {sizes_} lies outside it"
                )
            numel = math.prod(sizes_)
            volume += numel
            info = md.storage_data.get(MetadataIndex(key, torch.Size(offsets)))
            if info is None:
                raise PortingError(f"{path}: {where} at {offsets} has no stored bytes")
            need = numel * dtype.itemsize
            if need > info.length:
                raise PortingError(
                    f"{path}: tensor {key!r} is recorded as {shape} {dtype}, but its chunk at "
                    f"{offsets} of shape {sizes_} needs {need} bytes and its record in "
                    f"{info.relative_path} holds {info.length}"
                )
        if volume != math.prod(shape):
            raise PortingError(
                f"{path}: tensor {key!r} is recorded as {shape} ({math.prod(shape)} elements), but "
                f"its chunks hold {volume}"
            )


def read_record(weights: Path, info) -> bytes:
    """The bytes of the record ``info`` (a ``.metadata`` storage entry) in ``weights``, which
    :func:`read_metadata` has checked to lie inside a file of it."""
    path = weights / info.relative_path
    with open_file(path, weights) as f:
        if info.offset + info.length > os.fstat(f.fileno()).st_size:
            raise PortingError(f"{path}: truncated; a record needs bytes past its end")
        f.seek(info.offset)
        raw = f.read(info.length)
    if len(raw) != info.length:
        raise PortingError(f"{path}: truncated; a record needs bytes past its end")
    return raw


class DistCheckpointReader:
    """Region reads from the ``weights/`` directory of a NeMo 2.0 / Megatron checkpoint."""

    def __init__(self, weights: str | Path) -> None:
        self.dir = Path(weights)
        md = read_metadata(self.dir)
        self._tensors = {k: v for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
        self._storage = md.storage_data

    def keys(self) -> list[str]:
        """Every tensor key the checkpoint stores (model and, for a training checkpoint, optimizer)."""
        return list(self._tensors)

    def global_shape(self, key: str) -> tuple[int, ...]:
        """The whole tensor's shape as saved (stacked layer keys have a leading layer axis)."""
        if key not in self._tensors:
            raise PortingError(f"{self.dir}: the checkpoint has no tensor {key!r}")
        return tuple(self._tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        """The saved dtype of ``key``."""
        self.global_shape(key)
        return self._tensors[key].properties.dtype

    def _chunk(self, key: str, offsets: torch.Size) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._storage.get(MetadataIndex(key, offsets))
        if info is None:
            raise PortingError(f"{self.dir}: no stored bytes for {key!r} at {tuple(offsets)}")
        path = self.dir / info.relative_path
        if info.offset + info.length > regular_file(path, self.dir).stat().st_size:
            raise PortingError(f"{path}: truncated; {key!r} needs bytes past its end")
        try:
            return _mapped_record(path, info.offset, info.length, self.dir)
        except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError) as err:
            raise PortingError(f"{path}: the record of {key!r} is unreadable ({err})") from err

    def read(
        self,
        key: str,
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The region ``[offsets, offsets + shape)`` of ``key``, assembled from stored chunks.

        ``out``: a tensor of ``shape`` to assemble into, cast to its dtype on the way (the parity
        gate's fp32 layer buffers); by default a new one of the saved dtype.
        """
        full = self.global_shape(key)
        if len(offsets) != len(full) or len(shape) != len(full):
            raise PortingError(
                f"{self.dir}: {key!r} has {len(full)} dimensions, asked for {len(shape)}"
            )
        if out is None:
            out = torch.empty(shape, dtype=self.dtype(key))
        elif tuple(out.shape) != tuple(shape):
            raise PortingError(
                f"{self.dir}: {key!r} region {tuple(shape)} read into a buffer of "
                f"{tuple(out.shape)}"
            )
        covered = 0
        boxes: list[tuple[list[int], list[int]]] = []
        for chunk in self._tensors[key].chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
            hi = [
                min(o + s, c + cs)
                for o, s, c, cs in zip(offsets, shape, chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            # Overlapping chunks would count twice and leave a hole of the buffer unwritten.
            for blo, bhi in boxes:
                if all(max(a, c) < min(b, d) for a, b, c, d in zip(lo, hi, blo, bhi, strict=True)):
                    raise PortingError(f"{self.dir}: stored chunks of {key!r} overlap at {lo}")
            boxes.append((lo, hi))
            data = self._chunk(key, chunk.offsets)  # a view of the mapped file
            if tuple(data.shape) != tuple(chunk.sizes):
                raise PortingError(
                    f"{self.dir}: chunk of {key!r} at {tuple(chunk.offsets)} has shape "
                    f"{tuple(data.shape)}, the metadata says {tuple(chunk.sizes)}"
                )
            src = data[
                tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets, strict=True))
            ]
            dst = out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))]
            pages.copy_rows(dst, src, str(self.dir), key)
            covered += src.numel()
            del data
        if covered != out.numel():
            raise PortingError(
                f"{self.dir}: the stored chunks of {key!r} do not cover {tuple(offsets)} + "
                f"{tuple(shape)}"
            )
        return out

    def read_sharded(self, sharded, out: torch.Tensor | None = None) -> torch.Tensor:
        """The local tensor of a Megatron ``ShardedTensor`` or ``ShardedTensorFactory`` (data-free).

        A stacked layer key's ``ShardedTensor`` has a leading layer axis in the checkpoint
        (``prepend_axis_num``) that the module's parameter does not have. ``out``: a tensor of
        the local shape to read into (cast to its dtype), as for :meth:`read`.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        if isinstance(sharded, ShardedTensorFactory):
            built = sharded.build()
            if out is not None and _concatenates(sharded, built, out):
                start = 0  # each part straight into its rows: no merged copy of the whole
                for part in built:
                    rows = part.local_shape[0]
                    self.read_sharded(part, out=out[start : start + rows])
                    start += rows
                return out
            merged = sharded.merge_fn(_map_sharded(built, self.read_sharded))
            if out is None:
                return merged
            if tuple(merged.shape) != tuple(out.shape):
                raise PortingError(
                    f"{self.dir}: {sharded.key!r} merges to {tuple(merged.shape)}, read into a "
                    f"buffer of {tuple(out.shape)}"
                )
            return out.copy_(merged)
        if not isinstance(sharded, ShardedTensor):
            raise PortingError(f"cannot read {type(sharded).__name__} {sharded!r}")
        if sharded.flattened_range is not None:
            raise PortingError(f"{sharded.key}: flattened (distributed-optimizer) shards")
        prepend = sharded.prepend_axis_num
        shape = (1,) * prepend + tuple(sharded.local_shape)
        if out is not None and tuple(out.shape) != tuple(sharded.local_shape):
            raise PortingError(
                f"{self.dir}: {sharded.key!r} has local shape {tuple(sharded.local_shape)}, read "
                f"into a buffer of {tuple(out.shape)}"
            )
        region = self.read(
            sharded.key,
            tuple(sharded.global_offset),
            shape,
            None if out is None else out.view(shape),
        )
        return region.reshape(sharded.local_shape)


# Megatron's gated-MLP factory (``apply_swiglu_sharded_factory``): its merge is ``torch.cat`` of
# the parts along the first axis, a function of its own up to Megatron-Core 0.15 and
# ``cat_with_oom_fallback`` (``torch.cat``, retried on the host after a device OOM) from 0.16.
# Another factory is merged by its own function.
_CAT_MERGES = {
    ("megatron.core.transformer.mlp", "apply_swiglu_sharded_factory.<locals>.sh_ten_merge_fn"),
    ("megatron.core.transformer.utils", "cat_with_oom_fallback"),
}


def _concatenates(factory, built, out: torch.Tensor) -> bool:
    """Whether ``factory`` merges ``built`` by concatenating them along the first axis into
    ``out``'s shape."""
    merge = factory.merge_fn
    if (
        getattr(merge, "__module__", None),
        getattr(merge, "__qualname__", None),
    ) not in _CAT_MERGES:
        return False
    if not isinstance(built, list) or not built:
        return False
    shapes = [tuple(part.local_shape) for part in built]
    if any(s[1:] != tuple(out.shape[1:]) for s in shapes):
        return False
    return sum(s[0] for s in shapes) == out.shape[0]


def _map_sharded(tree, fn):
    if isinstance(tree, dict):
        return {k: _map_sharded(v, fn) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map_sharded(v, fn) for v in tree)
    return fn(tree)


class CheckpointParameters(Mapping):
    """A Megatron model's parameters (name -> tensor), each read from the checkpoint on access.

    ``sharded`` is the model's data-free ``sharded_state_dict(prefix=prefix)`` (built on the
    meta device; ``prefix`` is the layout's, ``module.`` for NeMo 2): it says where each parameter
    lives in the checkpoint. Nothing is cached, so a consumer that takes one parameter at a time
    holds one at a time.
    """

    def __init__(
        self, reader: DistCheckpointReader, sharded: dict, names, prefix: str = "module."
    ) -> None:
        self.reader, self.sharded, self.prefix = reader, sharded, prefix
        self.names = list(names)
        self._known = set(self.names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        item = self.sharded.get(self.prefix + name)
        if item is None:
            raise PortingError(f"{self.reader.dir}: the model's layout has no tensor for {name!r}")
        return self.reader.read_sharded(item)

    def __contains__(self, name: object) -> bool:
        # Mapping's own test reads the tensor (``self[name]``): a whole checkpoint read twice
        return name in self._known

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
