"""Streaming reads and sharded writes of Hugging Face weight files.

Reads go one tensor at a time through ``safetensors.safe_open`` (memory-mapped), honouring
``model.safetensors.index.json``, so an import never holds the whole HF checkpoint in memory.
Pickle checkpoints (``pytorch_model*.bin``) are refused unless the caller opts in, and even then are
only read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from porting.errors import PortingError

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

_DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def _check_safetensors_file(path: Path) -> None:
    """Validate a safetensors header against the file size, naming the file if it is truncated.

    ``safe_open`` memory-maps the file; a truncated file would otherwise fail later, inside a
    tensor read, with a message that names neither file nor tensor.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PortingError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise PortingError(f"{path}: truncated safetensors file (header says {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PortingError(f"{path}: corrupt safetensors header ({err})") from err
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, stop = info["data_offsets"]
        count = 1
        for d in info["shape"]:
            count *= d
        if (
            stop - start != count * _DTYPE_SIZES.get(info["dtype"], 0)
            and info["dtype"] in _DTYPE_SIZES
        ):
            raise PortingError(f"{path}: tensor {name!r} has inconsistent size in the header")
        end = max(end, stop)
    if 8 + n + end > size:
        raise PortingError(
            f"{path}: truncated safetensors file: data ends at byte {8 + n + end}, "
            f"file has {size} bytes"
        )


class SafetensorsSource:
    """Lazy, one-tensor-at-a-time reader of an HF checkpoint directory.

    Args:
        model_dir: the HF directory.
        allow_pickle: read ``pytorch_model*.bin`` when no safetensors exist (``weights_only=True``).
    """

    def __init__(self, model_dir: str | os.PathLike, allow_pickle: bool = False) -> None:
        self.dir = Path(model_dir)
        self._key_to_file: dict[str, Path] = {}
        self._pickled: dict[str, torch.Tensor] | None = None
        index = self.dir / SAFE_INDEX
        single = self.dir / SAFE_SINGLE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise PortingError(f"{index}: not a valid safetensors index ({err})") from err
            for key, fname in weight_map.items():
                self._key_to_file[key] = self.dir / fname
            files = sorted(set(self._key_to_file.values()))
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise PortingError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
            for f in files:
                _check_safetensors_file(f)
                with safe_open(f, framework="pt") as h:
                    actual = set(h.keys())
                listed = {k for k, v in self._key_to_file.items() if v == f}
                if listed - actual:
                    raise PortingError(
                        f"{f.name}: index lists tensor(s) the shard lacks: "
                        + ", ".join(sorted(listed - actual)[:5])
                    )
                for k in actual - listed:
                    raise PortingError(f"{f.name}: tensor {k!r} is not listed in {SAFE_INDEX}")
        elif single.exists():
            _check_safetensors_file(single)
            with safe_open(single, framework="pt") as h:
                for key in h.keys():
                    self._key_to_file[key] = single
        elif (self.dir / BIN_SINGLE).exists() or (self.dir / BIN_INDEX).exists():
            if not allow_pickle:
                raise PortingError(
                    f"{self.dir} holds only pickle weights (pytorch_model*.bin); pickle can run "
                    "code on load. Convert them to safetensors, or pass --allow-pickle to read "
                    "them with torch.load(weights_only=True)."
                )
            self._pickled = self._load_pickled()
        else:
            raise PortingError(f"{self.dir}: no weights found ({SAFE_SINGLE} or {SAFE_INDEX})")

    def _load_pickled(self) -> dict[str, torch.Tensor]:
        files = [self.dir / BIN_SINGLE]
        if (self.dir / BIN_INDEX).exists():
            weight_map = json.loads((self.dir / BIN_INDEX).read_text())["weight_map"]
            files = [self.dir / f for f in sorted(set(weight_map.values()))]
        out: dict[str, torch.Tensor] = {}
        for f in files:
            if not f.exists():
                raise PortingError(f"missing weight shard {f}")
            try:
                out.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
            except Exception as err:
                raise PortingError(f"{f}: cannot be read with weights_only=True ({err})") from err
        return out

    def keys(self) -> list[str]:
        """All tensor names in the checkpoint."""
        if self._pickled is not None:
            return list(self._pickled)
        return list(self._key_to_file)

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor (a fresh CPU tensor, not a view into the mapped file)."""
        if self._pickled is not None:
            return self._pickled[key]
        # A handle per read: the mapped pages are released right after the copy, so resident
        # memory never accumulates the shards already streamed (a kept handle would hold them).
        with safe_open(self._key_to_file[key], framework="pt") as h:
            return h.get_tensor(key)

    def dtypes(self) -> set[torch.dtype]:
        """The set of floating dtypes in the checkpoint (read from headers only where possible)."""
        seen: set[torch.dtype] = set()
        if self._pickled is not None:
            return {t.dtype for t in self._pickled.values() if t.is_floating_point()}
        for f in sorted(set(self._key_to_file.values())):
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    t = h.get_slice(k)
                    seen.add(_ST_TO_TORCH.get(t.get_dtype(), torch.float32))
        return seen

    def close(self) -> None:
        """Drop the tensors of a pickle checkpoint (safetensors reads hold nothing open)."""
        self._pickled = None


_ST_TO_TORCH = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


class ShardedWriter:
    """Write tensors into HF-style safetensors shards plus an index, as they arrive.

    Shards are flushed when they reach ``max_shard_bytes``; names are fixed up to
    ``model-0000i-of-0000N.safetensors`` at :meth:`close`, and a single shard is named
    ``model.safetensors`` with no index, as ``transformers`` writes them.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int = 5 * 2**30) -> None:
        self.out_dir = Path(out_dir)
        self.max = max_shard_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flush the current shard first if it would grow past the limit."""
        if key in self._buf or any(key in keys for _, keys in self._shards):
            raise PortingError(f"export produced HF key {key!r} twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max:
            self._flush()
        self._buf[key] = tensor.contiguous()
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self._shards):05d}.safetensors"
        save_file(self._buf, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> list[Path]:
        """Flush, name the shards and write the index; returns the shard paths."""
        if self._buf or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            final = self.out_dir / SAFE_SINGLE
            self._shards[0][0].rename(final)
            return [final]
        weight_map: dict[str, str] = {}
        paths = []
        for i, (path, keys) in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / name)
            paths.append(self.out_dir / name)
            weight_map.update({k: name for k in keys})
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return paths
