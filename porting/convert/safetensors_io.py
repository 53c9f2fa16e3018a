"""Streaming reads and sharded writes of Hugging Face weight files.

Reads go one tensor at a time through ``safetensors.safe_open`` (memory-mapped), honouring
``model.safetensors.index.json``, so an import never holds the whole HF checkpoint in memory.
Pickle checkpoints (``pytorch_model*.bin``) are refused unless the caller opts in, and even then are
only read with ``torch.load(weights_only=True)``.

Every file is checked before it is opened (:func:`porting.convert.hf_files.model_file`: a regular
file inside the model directory), index entries must name files inside the directory, and every
safetensors header is validated by :func:`read_safetensors_header` with the rules of the format's
reference reader, so a malformed checkpoint is refused naming the file and the tensor instead of
failing inside ``safe_open`` or, worse, being read.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch
from safetensors import SafetensorError, safe_open

from porting import pages, untrusted
from porting.contract.container import language_pairs, renamed
from porting.convert.hf_files import model_file, read_container, read_json
from porting.errors import PortingError, check_finite

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# The reference reader's limits and dtypes (huggingface/safetensors, safetensors/src/tensor.rs:
# MAX_HEADER_SIZE, Dtype::bitsize); sizes in bits, as the sub-byte float formats need.
MAX_HEADER_BYTES = 100_000_000
_DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
_USIZE_MAX = 2**64 - 1  # offsets and dims are usize in the reference reader


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype, shape and the byte range ``[start, end)`` in the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _is_usize(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _USIZE_MAX


def _refuse_constant(name: str) -> float:
    # NaN / Infinity are Python extensions of JSON; the reference reader refuses them
    raise ValueError(f"{name} is not JSON")


def _tensor_info(path: Path, name: str, entry: object) -> TensorInfo:
    """Validate one header entry (the reference reader's ``TensorInfo``)."""

    def bad(why: str) -> PortingError:
        return PortingError(f"{path}: tensor {name!r}: {why}")

    if not isinstance(entry, dict):
        raise bad(f"header entry must be an object, not {entry!r}"[:200])
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise bad(f"header entry lacks {field!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPE_BITS)})"[:300])
    if not isinstance(shape, list) or not all(_is_usize(d) for d in shape):
        raise bad(f"shape must be a list of non-negative integers, not {shape!r}"[:200])
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_usize(o) for o in offsets):
        raise bad(f"data_offsets must be [start, end] byte offsets, not {offsets!r}"[:200])
    start, end = offsets
    if start > end:
        raise bad(f"data_offsets [{start}, {end}] end before they start")
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * _DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - start:
        raise bad(
            f"shape {shape} of {dtype} needs {bits / 8:g} bytes, data_offsets [{start}, {end}] "
            f"give {end - start}"
        )
    return TensorInfo(dtype, tuple(shape), start, end)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Read and validate a safetensors header; return its tensors (name -> :class:`TensorInfo`).

    The rules are the reference reader's (``SafeTensors::read_metadata`` and
    ``Metadata::validate`` in huggingface/safetensors ``safetensors/src/tensor.rs``): an 8-byte
    little-endian header length of at most 100,000,000 bytes; a UTF-8 JSON object; an optional
    ``__metadata__`` object of strings; for every tensor a known ``dtype``, a ``shape`` of
    non-negative integers and ``data_offsets`` ``[start, end]`` holding exactly shape x dtype
    bytes; the tensors, ordered by offset, tile the data buffer from 0 without gap or overlap; and
    the buffer ends exactly at the end of the file. On top of that, a tensor name may appear only
    once. Each violation is a :class:`PortingError` naming the file and, where there is one, the
    tensor. ``path`` must already have passed :func:`model_file`.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PortingError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise PortingError(
                    f"{path}: safetensors header length {n} exceeds the format's limit of "
                    f"{MAX_HEADER_BYTES} bytes"
                )
            if n > size - 8:
                raise PortingError(
                    f"{path}: truncated safetensors file (header says {n} bytes, the file has "
                    f"{size - 8} after the length)"
                )
            raw = f.read(n)
    except OSError as err:
        raise PortingError(f"{path}: cannot be read ({err.strerror})") from err
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PortingError(f"{path}: safetensors header is not UTF-8 ({err})") from err
    try:
        header = json.loads(
            text, object_pairs_hook=untrusted.unique_keys, parse_constant=_refuse_constant
        )
    except (ValueError, RecursionError) as err:
        raise PortingError(f"{path}: corrupt safetensors header: not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise PortingError(
            f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, not an object"
        )
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise PortingError(
            f"{path}: '__metadata__' must be an object of strings, not {meta!r}"[:300]
        )
    tensors = {
        name: _tensor_info(path, name, entry)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    # Sorted by offsets, each tensor must start where the previous one ended.
    end, prev = 0, None
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if info.start != end:
            if prev is None:
                why = "the first tensor must start at byte 0 of the data buffer"
            elif info.start < end:
                why = f"overlaps tensor {prev!r}, which ends at byte {end}"
            else:
                why = f"leaves a gap after tensor {prev!r}, which ends at byte {end}"
            raise PortingError(
                f"{path}: tensor {name!r}: data_offsets [{info.start}, {info.end}] {why}; "
                "tensors must tile the data buffer without gaps or overlaps"
            )
        end, prev = info.end, name
    if 8 + n + end > size:
        raise PortingError(
            f"{path}: truncated safetensors file: data ends at byte {8 + n + end}"
            + (f" (tensor {prev!r})" if prev else "")
            + f", file has {size} bytes"
        )
    if 8 + n + end < size:
        raise PortingError(
            f"{path}: {size - 8 - n - end} unaccounted byte(s) after the last tensor"
            + (f" ({prev!r})" if prev else "")
            + "; the safetensors format requires the data to end the file"
        )
    return tensors


def _read_index(index: Path, model_dir: Path) -> dict[str, Path]:
    """``weight_map`` of a sharded checkpoint's index: tensor key -> shard path.

    Each shard must be named by a relative path inside the model directory: an absolute path, a
    ``..`` component, or a symlink out of the directory would read a file from elsewhere.
    """
    data = read_json(index, model_dir)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise PortingError(f"{index}: not a valid index: 'weight_map' must be an object")
    out: dict[str, Path] = {}
    for key, fname in weight_map.items():
        if not isinstance(fname, str) or not fname:
            raise PortingError(f"{index}: entry {key!r}: shard must be a file name, not {fname!r}")
        rel = PurePath(fname)
        if rel.is_absolute() or os.path.isabs(fname) or ".." in rel.parts:
            raise PortingError(
                f"{index}: entry {key!r} names shard {fname!r}; shards must be relative file "
                "names inside the model directory"
            )
        out[key] = model_dir / rel
    return out


def _safe_open(path: Path):
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as err:
        raise PortingError(f"{path}: cannot be read as safetensors ({err})") from err


class SafetensorsSource:
    """Lazy, one-tensor-at-a-time reader of an HF checkpoint directory.

    A quantized checkpoint (``config.json``'s ``quantization_config``, :mod:`porting.convert.quant`)
    presents each weight under its unquantized name, shape and compute dtype, dequantized when read;
    its stored parts (FP8 weight and scale, MXFP4 blocks and scales) are not keys of their own.

    Args:
        model_dir: the HF directory.
        allow_pickle: read ``pytorch_model*.bin`` when no safetensors exist (``weights_only=True``).
        dequantizer: what makes a quantized weight from its parts (default: ours,
            :data:`porting.convert.quant.OURS`; the parity gate passes transformers').
        hf_config: the directory's ``config.json`` as written, where the caller has read it
            (:class:`porting.convert.hf_files.HFSource`); else it is read here.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        allow_pickle: bool = False,
        dequantizer=None,
        hf_config: dict | None = None,
    ) -> None:
        self.dir = Path(model_dir)
        self._quant = None  # a QuantizedView where the checkpoint is quantized
        self._dequantizer = dequantizer
        self._key_to_file: dict[str, Path] = {}
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._data_start: dict[Path, int] = {}  # where each file's data buffer begins
        # size and mtime when the header was checked: a shard rewritten or truncated while an
        # import streams from it is an error, not a wrong tensor (or a SIGBUS from the mapping)
        self._stamps: dict[Path, tuple[int, int]] = {}
        self._pickled: dict[str, torch.Tensor] | None = None
        index = self.dir / SAFE_INDEX
        single = self.dir / SAFE_SINGLE
        if _present(index):
            self._key_to_file = _read_index(index, self.dir)
            files = sorted(set(self._key_to_file.values()))
            missing = [str(f.relative_to(self.dir)) for f in files if not _present(f)]
            if missing:
                raise PortingError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
            for f in files:
                model_file(f, self.dir)
                actual = set(self._read_header(f))
                listed = {k for k, v in self._key_to_file.items() if v == f}
                if listed - actual:
                    raise PortingError(
                        f"{f}: {SAFE_INDEX} lists tensor(s) the shard lacks: "
                        + ", ".join(sorted(listed - actual)[:5])
                    )
                if actual - listed:
                    k = sorted(actual - listed)[0]
                    raise PortingError(f"{f}: tensor {k!r} is not listed in {SAFE_INDEX}")
        elif _present(single):
            model_file(single, self.dir)
            for key in self._read_header(single):
                self._key_to_file[key] = single
        elif _present(self.dir / BIN_SINGLE) or _present(self.dir / BIN_INDEX):
            if not allow_pickle:
                raise PortingError(
                    f"{self.dir} holds only pickle weights (pytorch_model*.bin); pickle can run "
                    "code on load. Convert them to safetensors, or pass --allow-pickle to read "
                    "them with torch.load(weights_only=True)."
                )
            self._pickled = self._load_pickled()
        else:
            raise PortingError(f"{self.dir}: no weights found ({SAFE_SINGLE} or {SAFE_INDEX})")
        # published name -> packed_experts.Slice, or the stored name a renamed tensor has
        self._unpacked: dict[str, object] = {}
        if self._pickled is None:
            config = self.dir / "config.json"
            if hf_config is None:
                hf_config = read_json(config, self.dir) if _present(config) else {}
            if not isinstance(hf_config, dict):
                hf_config = {}
            self._plan_quantized(hf_config, config)
            self._plan_unpacked(hf_config)

    def _plan_unpacked(self, hf_config: dict) -> None:
        """Experts stored stacked by transformers 5 (:mod:`porting.convert.packed_experts`): each
        expert's tensors presented under its published name."""
        from porting.convert import packed_experts

        shapes = {k: self._headers[f][k].shape for k, f in self._key_to_file.items()}
        self._unpacked = packed_experts.plan(hf_config.get("model_type"), shapes, str(self.dir))
        if self._unpacked and self._quant is not None:
            raise PortingError(
                f"{self.dir}: experts stored stacked (transformers 5's save_original_format="
                "False) and quantized: not read; save it with its original names"
            )
        self._stacked = {
            v.stored if isinstance(v, packed_experts.Slice) else v for v in self._unpacked.values()
        }

    @property
    def experts_stacked(self) -> bool:
        """Whether experts are stored stacked (and read here as their published tensors)."""
        return bool(self._unpacked)

    def _plan_quantized(self, hf_config: dict, config: Path) -> None:
        """Read ``config.json``'s ``quantization_config`` and plan the dequantized weights; refused
        here, before any tensor is read, where it or the stored parts are not what we read."""
        from porting.contract.quantization import read_quantization
        from porting.convert import quant

        method = read_quantization(hf_config, str(config))
        stored = {
            k: (self._headers[f][k].dtype, self._headers[f][k].shape, f)
            for k, f in self._key_to_file.items()
        }
        if method is None and not any(dt.startswith("F8_") for dt, _, _ in stored.values()):
            return
        dtype = quant.compute_dtype(hf_config, str(config))
        self._quant = quant.QuantizedView(stored, method, dtype, str(config))
        self._quant.check_scales(
            lambda key: self._view(key, _RAW_TORCH), lambda key: str(self._key_to_file[key])
        )

    def dequantized(self) -> tuple[str, int] | None:
        """``(quant_method, number of weights)`` this reader dequantizes; ``None`` for none."""
        if self._quant is None or not self._quant.planned:
            return None
        return self._quant.quant.method, len(self._quant.planned)

    def _planned(self, key: str):
        return self._quant.planned.get(key) if self._quant is not None else None

    def _dequantized(self, key: str, expert: int | None = None) -> torch.Tensor:
        """Weight ``key`` dequantized; with ``expert``, only that index of its parts' first
        dimension (a stack's expert: the arithmetic is per expert, so it is the whole's slice)."""
        from porting.convert import quant

        def read(part: str) -> torch.Tensor:
            # the view itself: it keeps its private mapping alive, and a copy would be one more
            # full-size tensor
            with self._view(part, _RAW_TORCH) as view:
                return view if expert is None else view[expert : expert + 1]

        path = self._key_to_file[self._planned(key).parts[0]]
        whole = self._quant.dequantize(key, read, self._dequantizer or quant.OURS, str(path))
        return whole if expert is None else whole[0]

    def _read_header(self, path: Path) -> dict[str, TensorInfo]:
        header = read_safetensors_header(path)
        # The reference reader must agree (it is the one that maps the file for reads).
        with _safe_open(path) as h:
            if set(h.keys()) != set(header):
                raise PortingError(f"{path}: safetensors lists other tensors than its header")
        self._headers[path] = header
        st = path.stat()
        self._stamps[path] = (st.st_size, st.st_mtime_ns)
        # The validated header says the data buffer ends the file.
        self._data_start[path] = st.st_size - max((i.end for i in header.values()), default=0)
        return header

    def _load_pickled(self) -> dict[str, torch.Tensor]:
        files = [self.dir / BIN_SINGLE]
        if _present(self.dir / BIN_INDEX):
            files = sorted(set(_read_index(self.dir / BIN_INDEX, self.dir).values()))
        out: dict[str, torch.Tensor] = {}
        for f in files:
            if not _present(f):
                raise PortingError(f"missing weight shard {f}")
            model_file(f, self.dir)
            try:
                state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:
                raise PortingError(f"{f}: cannot be read with weights_only=True ({err})") from err
            if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
            ):
                raise PortingError(f"{f}: not a state dict (tensor names -> tensors)")
            out.update(state)
        return out

    def keys(self) -> list[str]:
        """All tensor names in the checkpoint (a quantized weight's unquantized name)."""
        if self._pickled is not None:
            return list(self._pickled)
        if self._quant is not None:
            return self._quant.keys(list(self._key_to_file))
        if self._unpacked:
            return [k for k in self._key_to_file if k not in self._stacked] + list(self._unpacked)
        return list(self._key_to_file)

    def _unpack(self, key: str, view: torch.Tensor) -> torch.Tensor:
        """The published tensor ``key`` inside ``view``, its stored stack."""
        part = self._unpacked[key]
        view = view[part.expert]
        return view if part.rows is None else view[part.rows[0] : part.rows[1]]

    def _stored(self, key: str) -> str:
        """The stored tensor that holds published ``key``."""
        part = self._unpacked.get(key, key)
        return part if isinstance(part, str) else part.stored

    def _unchanged(self, path: Path, key: str) -> None:
        st = path.stat()
        if (st.st_size, st.st_mtime_ns) != self._stamps[path]:
            raise PortingError(
                f"{path}: changed while being read (size {self._stamps[path][0]} -> "
                f"{st.st_size}); reading {key!r} would give a wrong tensor"
            )

    @contextmanager
    def mapped(self, key: str, expert: int | None = None) -> Iterator[torch.Tensor]:
        """One tensor as a view of the mapped file (private: writes to it reach no file); with
        ``expert``, that index of its first dimension (one expert of a stack).

        For a reader that copies it on at once (the parity gate casts it straight into the
        buffer its layer computes with): no intermediate tensor is made, and a quantized stack
        is dequantized for that expert alone. The caller checks the copy for NaN/Inf
        (:func:`porting.errors.check_finite`); a view is not checked here.
        """
        if self._planned(key) is not None and self._pickled is None:
            yield self._dequantized(key, expert)
            return
        with self._mapped_whole(key) as whole:
            yield whole if expert is None else whole[expert]

    @contextmanager
    def _mapped_whole(self, key: str) -> Iterator[torch.Tensor]:
        if self._pickled is not None:
            yield self._pickled[key]
            return
        if key in self._unpacked:
            with self._view(self._stored(key), _ST_TO_TORCH) as view:
                yield view if isinstance(self._unpacked[key], str) else self._unpack(key, view)
            return
        with self._view(key, _ST_TO_TORCH) as view:
            yield view

    @contextmanager
    def _view(self, key: str, dtypes: dict[str, torch.dtype]) -> Iterator[torch.Tensor]:
        path = self._key_to_file[key]
        self._unchanged(path, key)
        info = self._headers[path][key]
        dtype = dtypes.get(info.dtype)
        if dtype is None:
            raise PortingError(f"{path}: tensor {key!r} has dtype {info.dtype}, not a torch one")
        with open(path, "rb") as f:
            # A private mapping: torch.frombuffer wants a writable buffer; nothing writes to it.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        pages.register(mm)
        count = math.prod(info.shape)
        try:
            if count:
                start = self._data_start[path] + info.start
                view = torch.frombuffer(mm, dtype=dtype, count=count, offset=start)
            else:
                view = torch.empty(0, dtype=dtype)
            yield view.view(info.shape)
        finally:
            # Not closed: a tensor made by frombuffer keeps the map object alive but does not
            # pin it, and closing under a view the caller kept would fault. The mapping goes
            # when its last view does (at once, for a caller that only copied it).
            view = mm = None

    def expert(self, key: str, index: int) -> torch.Tensor:
        """Index ``index`` of stacked tensor ``key``'s first dimension (one expert of a stack), a
        fresh tensor copied out of a mapping made for it and dropped after (a quantized stack
        dequantized for that expert alone): the stack's pages are never resident together, where
        a whole stack held while its experts are copied out leaves all of them so (4 GB for a
        Llama 4 Scout layer's two stacks)."""
        shape, path = self.shape(key)
        if not shape or not 0 <= index < shape[0]:
            raise PortingError(
                f"tensor {key!r} stacks {shape[0] if shape else 0} experts; the table reads "
                f"slice {index}"
            )
        with self.mapped(key, index) as view:
            t = view.clone()
        check_finite(t, str(path), key)
        return t

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor: a view of the file mapped for this read, checked finite (a quantized
        weight dequantized, a published expert copied out of its stack: fresh tensors)."""
        if self._pickled is not None:
            check_finite(self._pickled[key], str(self.dir), key)
            return self._pickled[key]
        if self._planned(key) is not None:
            t = self._dequantized(key)
            check_finite(t, str(self._key_to_file[self._planned(key).parts[0]]), key)
            return t
        if key in self._unpacked:
            stored = self._stored(key)
            if isinstance(self._unpacked[key], str):
                return self.get(stored)
            # one expert's rows copied out of the mapped stack: the stack is never read whole
            with self._view(stored, _ST_TO_TORCH) as view:
                t = self._unpack(key, view).clone()
            check_finite(t, str(self._key_to_file[stored]), key)
            return t
        path = self._key_to_file[key]
        # A view of a mapping made for this read (as safetensors' own reader gives since 0.6),
        # checked a block at a time with each block's pages released: a table is not resident
        # until its reader copies it, and then a block at a time where it copies by
        # :mod:`porting.pages`. The mapping goes with the last view.
        with self._view(key, _READ_TORCH) as view:
            t = view
        pages.check_rows(t, str(path), key)
        return t

    def shape(self, key: str) -> tuple[tuple[int, ...], Path]:
        """A tensor's shape as its header (or loaded pickle) gives it, and the file holding it."""
        if self._pickled is not None:
            return tuple(self._pickled[key].shape), self.dir
        plan = self._planned(key)
        if plan is not None:
            return plan.shape, self._key_to_file[plan.parts[0]]
        if key in self._unpacked:
            stored = self._stored(key)
            shape, path = self.shape(stored)
            part = self._unpacked[key]
            if isinstance(part, str):
                return shape, path
            rows = shape[1] if part.rows is None else part.rows[1] - part.rows[0]
            return (rows, *shape[2:]), path
        path = self._key_to_file[key]
        return self._headers[path][key].shape, path

    def stored_dtype(self, key: str) -> tuple[str, Path]:
        """A tensor's dtype as safetensors names it (``BF16``, ``I32``; for a pickle checkpoint
        the torch dtype mapped to that name) and the file holding it."""
        if self._pickled is not None:
            dtype = self._pickled[key].dtype
            return _TORCH_TO_ST.get(dtype, str(dtype).removeprefix("torch.")), self.dir
        if self._planned(key) is not None:
            return _TORCH_TO_ST[self._quant.dtype], self._key_to_file[self._planned(key).parts[0]]
        key = self._stored(key)
        path = self._key_to_file[key]
        return self._headers[path][key].dtype, path

    def dtypes(self, skip: Callable[[str], bool] = lambda key: False) -> set[torch.dtype]:
        """The set of floating dtypes in the checkpoint, but for the tensors ``skip`` names (read
        from headers only where possible)."""
        if self._pickled is not None:
            return {
                t.dtype for k, t in self._pickled.items() if t.is_floating_point() and not skip(k)
            }
        parts = self._quant.parts if self._quant is not None else set()
        found = {
            _ST_TO_TORCH[info.dtype]
            for header in self._headers.values()
            for key, info in header.items()
            if info.dtype in _ST_TO_TORCH and key not in parts and not skip(key)
        }
        return found | ({self._quant.dtype} if self._quant is not None and parts else set())

    def close(self) -> None:
        """Drop the tensors of a pickle checkpoint (safetensors reads hold nothing open)."""
        self._pickled = None


def _present(path: Path) -> bool:
    """Whether a directory entry exists at ``path`` (a dangling symlink counts: refused later)."""
    return path.exists() or path.is_symlink()


_ST_TO_TORCH = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
# what a quantized weight's stored parts are read as (never weights of their own)
_RAW_TORCH = {**_ST_TO_TORCH, "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}
# what a tensor read as itself may be stored as (safetensors' own reader's dtypes that torch has)
_READ_TORCH = {
    **_RAW_TORCH, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "BOOL": torch.bool,
}  # fmt: skip


# safetensors orders a file's tensors by dtype, widest first, then by name
# (safetensors/src/tensor.rs, ``prepare``: the Dtype enum's order, descending).
_ST_DTYPE_RANK = {
    "F64": 5, "F32": 4, "BF16": 3, "F16": 2, "I64": 6, "I32": 4, "F8_E4M3": 1, "U8": 0
}  # fmt: skip
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}
# what a writer writes: weights' dtypes, FP8 for ``--quantize fp8-block``, and MXFP4's bytes
_WRITE_ST = {**_TORCH_TO_ST, torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}


class StreamingShardWriter:
    """HF-style safetensors shards written tensor by tensor, holding none of them.

    The tensors' names, shapes and dtypes are known before their data (``specs``, in export
    order), so shards are planned up front exactly as ``transformers`` and our former buffered
    writer cut them (a new shard when the next tensor would pass ``max_shard_bytes``), each file's
    header is written first in ``safetensors``' own layout (``__metadata__`` first, tensors
    ordered by dtype then name, compact JSON padded with spaces to 8 bytes), and each tensor's bytes
    go straight to their offset when :meth:`write` gets them. The files are byte-identical to
    ``safetensors.torch.save_file`` of the same tensors. Shards are written under hidden names and
    renamed (``model-0000i-of-0000N.safetensors``, or ``model.safetensors`` alone, with the index)
    by :meth:`close`, after every tensor arrived.
    """

    def __init__(
        self,
        out_dir: Path,
        specs: list[tuple[str, tuple[int, ...], torch.dtype]],
        max_shard_bytes: int = 5 * 2**30,
        mine: set[str] | None = None,
        create: bool = True,
        parts: dict[str, tuple[str, int, tuple[int, ...]]] | None = None,
    ) -> None:
        """``mine``: the tensors this writer writes (default all): the ranks of a launched export
        write their shares into the same planned files, which the one with ``create`` makes
        (headers, sizes) before the others open them. ``parts``: tensors written into a stored
        one, ``{name: (stored name, offset in elements, shape)}`` (experts stacked as
        transformers 5 stores them: :func:`porting.convert.packed_experts.stacked_plan`); each
        is written with :meth:`write` under its own name, ``mine`` names them so too."""
        self.out_dir = Path(out_dir)
        self._where: dict[str, tuple[int, int, int, torch.dtype, tuple[int, ...]]] = {}
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
        size = 0
        seen: set[str] = set()
        for key, shape, dtype in specs:
            if key in seen:
                raise PortingError(f"export produces HF key {key!r} twice")
            seen.add(key)
            if dtype not in _WRITE_ST:
                raise PortingError(f"{key}: cannot write dtype {dtype} to safetensors")
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((key, tuple(shape), dtype, nbytes))
            size += nbytes
        self.total_bytes = sum(n for sh in shards for *_, n in sh)
        self._paths = [self.out_dir / f".shard-{i:05d}.safetensors" for i in range(len(shards))]
        self._keys = [[k for k, *_ in sh] for sh in shards]
        for i, shard in enumerate(shards):
            ordered = sorted(shard, key=lambda t: (-_ST_DTYPE_RANK[_WRITE_ST[t[2]]], t[0]))
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for key, shape, dtype, nbytes in ordered:
                header[key] = {
                    "dtype": _WRITE_ST[dtype],
                    "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes],
                }
                offset += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            if create:
                with open(self._paths[i], "wb") as f:
                    f.write(struct.pack("<Q", len(raw)))
                    f.write(raw)
                    f.truncate(8 + len(raw) + offset)
            for key, shape, dtype, nbytes in ordered:
                start = header[key]["data_offsets"][0]
                self._where[key] = (i, 8 + len(raw) + start, nbytes, dtype, shape)
        self._parts = dict(parts or {})
        whole = set(self._where) - {stored for stored, _, _ in self._parts.values()}
        every = whole | set(self._parts)
        self._pending = every if mine is None else every & set(mine)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write one tensor's bytes at its place (its name, shape and dtype as announced)."""
        if key not in self._pending:
            raise PortingError(f"export produced HF key {key!r} unannounced or twice")
        if key in self._parts:
            stored, first, shape = self._parts[key]
            shard, offset, _, dtype, _ = self._where[stored]
            offset += first * dtype.itemsize
        else:
            shard, offset, _, dtype, shape = self._where[key]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise PortingError(
                f"export produced {key!r} as {tuple(tensor.shape)} {tensor.dtype}, "
                f"announced {shape} {dtype}"
            )
        data = tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
        with open(self._paths[shard], "r+b") as f:
            f.seek(offset)
            f.write(memoryview(data))
        self._pending.discard(key)

    def finish(self) -> None:
        """Check every tensor of this writer's share arrived, and its bytes are on disk."""
        if self._pending:
            raise PortingError(
                f"export did not produce {len(self._pending)} announced tensor(s): "
                + ", ".join(sorted(self._pending)[:5])
            )
        for path in self._paths:
            with open(path, "r+b") as f:
                os.fsync(f.fileno())

    def close(self) -> list[Path]:
        """Check every tensor arrived, name the shards and write the index; the shard paths.
        (A launched export: every rank's :meth:`finish` first, then one rank's ``close``.)"""
        self.finish()
        return self.publish()

    def publish(self) -> list[Path]:
        """Name the shards and write the index; the shard paths."""
        n = len(self._paths)
        if n == 1:
            final = self.out_dir / SAFE_SINGLE
            self._paths[0].rename(final)
            return [final]
        weight_map: dict[str, str] = {}
        paths = []
        for i, path in enumerate(self._paths):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / name)
            paths.append(self.out_dir / name)
            weight_map.update({k: name for k in self._keys[i]})
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return paths


class RenamedSource:
    """A container checkpoint's language-model tensors under other names (``pairs``: stored
    prefix -> shown prefix, :func:`porting.contract.container.language_pairs`); every other
    tensor is :attr:`carried`. The reader interface of :class:`SafetensorsSource`."""

    def __init__(self, inner: SafetensorsSource, pairs, spelling, held) -> None:
        self.inner, self.dir, self.spelling, self.held = inner, inner.dir, spelling, held
        self._stored: dict[str, str] = {}
        self.carried: list[str] = []
        for key in inner.keys():
            shown = renamed(key, pairs)
            if shown is None:
                self.carried.append(key)
            else:
                self._stored[shown] = key

    def stored_name(self, key: str) -> str:
        """The name the checkpoint stores the tensor shown as ``key`` under."""
        try:
            return self._stored[key]
        except KeyError:
            raise PortingError(f"{self.dir}: tensor {key!r} is missing") from None

    def keys(self) -> list[str]:
        return list(self._stored)

    def get(self, key: str) -> torch.Tensor:
        return self.inner.get(self.stored_name(key))

    def expert(self, key: str, index: int) -> torch.Tensor:
        return self.inner.expert(self.stored_name(key), index)

    def shape(self, key: str):
        return self.inner.shape(self.stored_name(key))

    def stored_dtype(self, key: str):
        return self.inner.stored_dtype(self.stored_name(key))

    @contextmanager
    def mapped(self, key: str, expert: int | None = None):
        with self.inner.mapped(self.stored_name(key), expert) as t:
            yield t

    def dtypes(self, skip: Callable[[str], bool] = lambda key: False) -> set[torch.dtype]:
        shown = {v: k for k, v in self._stored.items()}
        return self.inner.dtypes(skip=lambda key: key not in shown or skip(shown[key]))

    def renamed_as(self, names: str) -> RenamedSource:
        """The same checkpoint's language model under ``names`` (``"text"`` or ``"own"``)."""
        pairs, spelling = language_pairs(self.held, self.inner.keys(), str(self.dir), names)
        return RenamedSource(self.inner, pairs, spelling, self.held)

    def __getattr__(self, name: str):  # dequantized(), experts_stacked, close()
        return getattr(self.inner, name)


def _language(source: SafetensorsSource, held, names: str):
    if held is None:
        return source
    pairs, spelling = language_pairs(held, source.keys(), str(source.dir), names)
    return RenamedSource(source, pairs, spelling, held)


def hf_weights(
    hf, allow_pickle: bool = False, dequantizer=None, names: str = "text"
) -> SafetensorsSource:
    """The weights of the :class:`~porting.convert.hf_files.HFSource` ``hf``, read with the
    config it holds (not read again). A vision-language container's are its language model's,
    under its family's text class's names (``names="text"``) or the container class's own
    (``"own"``: the gate's reference), the rest carried (:class:`RenamedSource`)."""
    source = SafetensorsSource(
        hf.path, allow_pickle=allow_pickle, dequantizer=dequantizer, hf_config=hf.raw_config
    )
    return _language(source, hf.container, names)


def weights_at(
    hf_dir, allow_pickle: bool = False, dequantizer=None, names: str = "text"
) -> SafetensorsSource:
    """The weights of the HF directory ``hf_dir`` read by path, as :func:`hf_weights` reads an
    opened one (a vision-language container's language model under ``names``)."""
    source = SafetensorsSource(hf_dir, allow_pickle=allow_pickle, dequantizer=dequantizer)
    return _language(source, read_container(hf_dir), names)
