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
``torch.load(weights_only=True)``; nothing else is held.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import torch

from porting.errors import PortingError, check_finite


class DistCheckpointReader:
    """Region reads from the ``weights/`` directory of a NeMo 2.0 / Megatron checkpoint."""

    def __init__(self, weights: str | Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.dir = Path(weights)
        if not (self.dir / ".metadata").is_file():
            raise PortingError(f"{self.dir}: no .metadata; not a torch_dist checkpoint")
        try:
            md = FileSystemReader(str(self.dir)).read_metadata()
        except Exception as err:  # torch raises several types for a corrupt file
            raise PortingError(f"{self.dir}/.metadata: unreadable ({err})") from err
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
        if Path(info.relative_path).name != info.relative_path or not path.is_file():
            raise PortingError(f"{self.dir}: {key!r} points at {info.relative_path!r}")
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise PortingError(f"{path}: truncated; {key!r} needs bytes past its end")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def read(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region ``[offsets, offsets + shape)`` of ``key``, assembled from stored chunks."""
        full = self.global_shape(key)
        if len(offsets) != len(full) or len(shape) != len(full):
            raise PortingError(
                f"{self.dir}: {key!r} has {len(full)} dimensions, asked for {len(shape)}"
            )
        out = torch.empty(shape, dtype=self.dtype(key))
        covered = 0
        for chunk in self._tensors[key].chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
            hi = [
                min(o + s, c + cs)
                for o, s, c, cs in zip(offsets, shape, chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            data = self._chunk(key, chunk.offsets)
            if tuple(data.shape) != tuple(chunk.sizes):
                raise PortingError(
                    f"{self.dir}: chunk of {key!r} at {tuple(chunk.offsets)} has shape "
                    f"{tuple(data.shape)}, the metadata says {tuple(chunk.sizes)}"
                )
            src = data[
                tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets, strict=True))
            ]
            check_finite(src, str(self.dir), key)
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))] = src
            covered += src.numel()
            del data
        if covered != out.numel():
            raise PortingError(
                f"{self.dir}: the stored chunks of {key!r} do not cover {tuple(offsets)} + "
                f"{tuple(shape)}"
            )
        return out

    def read_sharded(self, sharded) -> torch.Tensor:
        """The local tensor of a Megatron ``ShardedTensor`` or ``ShardedTensorFactory`` (data-free).

        A stacked layer key's ``ShardedTensor`` has a leading layer axis in the checkpoint
        (``prepend_axis_num``) that the module's parameter does not have.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        if isinstance(sharded, ShardedTensorFactory):
            built = sharded.build()
            return sharded.merge_fn(_map_sharded(built, self.read_sharded))
        if not isinstance(sharded, ShardedTensor):
            raise PortingError(f"cannot read {type(sharded).__name__} {sharded!r}")
        if sharded.flattened_range is not None:
            raise PortingError(f"{sharded.key}: flattened (distributed-optimizer) shards")
        prepend = sharded.prepend_axis_num
        region = self.read(
            sharded.key,
            tuple(sharded.global_offset),
            (1,) * prepend + tuple(sharded.local_shape),
        )
        return region.reshape(sharded.local_shape)


def _map_sharded(tree, fn):
    if isinstance(tree, dict):
        return {k: _map_sharded(v, fn) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map_sharded(v, fn) for v in tree)
    return fn(tree)


class CheckpointParameters(Mapping):
    """A Megatron model's parameters (name -> tensor), each read from the checkpoint on access.

    ``sharded`` is the model's data-free ``sharded_state_dict(prefix="module.")`` (built on the
    meta device): it says where each parameter lives in the checkpoint. Nothing is cached, so a
    consumer that takes one parameter at a time holds one at a time.
    """

    def __init__(self, reader: DistCheckpointReader, sharded: dict, names) -> None:
        self.reader, self.sharded = reader, sharded
        self.names = list(names)
        self._known = set(self.names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        item = self.sharded.get("module." + name)
        if item is None:
            raise PortingError(f"{self.reader.dir}: the model's layout has no tensor for {name!r}")
        return self.reader.read_sharded(item)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
