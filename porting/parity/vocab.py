"""The vocabulary's tables read by slices: an embedding and an output layer never whole.

At a frontier vocabulary one table is the largest tensor of a model: 129,280 x 7168 (DeepSeek-V3)
is 3.7 GB in fp32, 202,048 x 5120 (Llama 4) 4.1 GB, and the streamed gate's other bound is a
decoder layer. :class:`VocabTable` stands in for such a table on the model while the gate runs,
holding no values: the model's own forward runs unchanged, and the operations it makes with the
table are computed from the stored rows they need:

- a lookup (``F.embedding``, or indexing by a tensor of ids, Megatron-Core's deterministic
  path) reads the rows of the ids asked for, run by run of neighbouring ids;
- a product (``F.linear(x, W, b)``, or ``torch.matmul(x, W.t())`` as Megatron-Core's linear
  computes it) reads the table a slice of rows at a time (:data:`SLICE_BYTES` in fp32), the
  next slice on a thread while the current one is multiplied, and writes each slice's columns of
  the output.

Each output value is the same dot product of the same fp32 values as with the whole table in
memory; only which rows are in memory at a time changes. Any other operation on the table reads
it whole, once, and says so (a warning): correct, at the whole table's memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from porting.convert.preflight import VOCAB_SLICE_BYTES

log = logging.getLogger(__name__)

# fp32 bytes of one slice of a product; two are in memory at a time (one read while the other is
# multiplied). 128 MiB is 4,681 rows at a width of 7168: a 129,280-row head in 28 slices. The
# gate's memory bound counts them (porting.convert.preflight.gate_memory).
SLICE_BYTES = VOCAB_SLICE_BYTES
# rows of a slice where set, in place of SLICE_BYTES (porting.parity.streamed.finest_grain)
SLICE_ROWS: int | None = None
# False: an operation the slices do not cover fails rather than reading the table whole (the
# proof kit's finest grain, so that a family's tests find it)
WHOLE_ALLOWED = True

# ids closer than this are read as one run of rows (fewer reads, a few unused rows)
_RUN_GAP = 64

# What a product's two slices are read into: ``take()`` gives a ``take(name, shape)`` for one
# product (the streamed gate's: a free layer area where one is made, porting.parity.streamed)
Take = Callable[[str, torch.Size], torch.Tensor]

# ``read(start, stop, out)``: rows ``[start, stop)`` of the stored table, cast into ``out``
# (fp32, ``[stop - start, hidden]``, on the gate's device)
ReadRows = Callable[[int, int, torch.Tensor], None]


class VocabTable:
    """A ``[vocab, hidden]`` fp32 table that reads its rows from storage when an operation needs
    them (module docstring). ``name``: the stored tensor's, for messages."""

    dtype = torch.float32
    requires_grad = False
    is_meta = False

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        read: ReadRows,
        device: torch.device,
        take: Callable[[], Take] | None = None,
    ):
        if len(shape) != 2:
            raise ValueError(f"{name}: a vocabulary table has two dimensions, not {tuple(shape)}")
        self.name = name
        self.shape = torch.Size(shape)
        self.device = torch.device(device)
        self._read = read
        self._take = take
        self.slice_rows = SLICE_ROWS or max(1, SLICE_BYTES // (4 * self.shape[1]))
        self.rows_read = 0  # what the operations read, counted for the tests and the report

    ndim = 2

    def dim(self) -> int:
        return 2

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def numel(self) -> int:
        return self.shape.numel()

    def t(self) -> _Transposed:
        return _Transposed(self)

    @property
    def T(self) -> _Transposed:  # noqa: N802 (torch's name)
        return _Transposed(self)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"VocabTable({self.name!r}, {tuple(self.shape)})"

    def rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` in fp32 on the table's device."""
        if out is None:
            out = torch.empty(stop - start, self.shape[1], dtype=self.dtype, device=self.device)
        self._read(start, stop, out)
        self.rows_read += stop - start
        return out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]``: ``[*ids.shape, hidden]``, from the rows of the distinct ids only."""
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{self.name}: looked up by {ids.dtype} values, not ids")
        flat = ids.reshape(-1)
        if flat.numel() == 0:
            return torch.empty(*ids.shape, self.shape[1], dtype=self.dtype, device=self.device)
        wanted, where = torch.unique(flat, sorted=True, return_inverse=True)
        low, high = int(wanted[0]), int(wanted[-1])
        if low < 0 or high >= self.shape[0]:
            raise IndexError(
                f"{self.name}: id {low if low < 0 else high} is out of range for a vocabulary "
                f"of {self.shape[0]}"
            )
        found = torch.empty(len(wanted), self.shape[1], dtype=self.dtype, device=self.device)
        host = wanted.cpu()
        breaks = (torch.nonzero(host[1:] - host[:-1] > _RUN_GAP).flatten() + 1).tolist()
        for first, last in zip([0, *breaks], [*breaks, len(host)], strict=True):
            start, stop = int(host[first]), int(host[last - 1]) + 1
            block = self.rows(start, stop)
            found[first:last] = block[(wanted[first:last] - start).to(self.device)]
        return found[where.to(self.device)].view(*ids.shape, self.shape[1])

    def product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, table, bias)``: ``[..., vocab]``, the table read slice by slice."""
        if x.shape[-1] != self.shape[1]:
            raise RuntimeError(
                f"{self.name}: input of width {x.shape[-1]} against a table of {tuple(self.shape)}"
            )
        vocab = self.shape[0]
        out = torch.empty(*x.shape[:-1], vocab, dtype=x.dtype, device=x.device)
        bounds = [(a, min(a + self.slice_rows, vocab)) for a in range(0, vocab, self.slice_rows)]
        shape = torch.Size((min(self.slice_rows, vocab), self.shape[1]))
        take = self._take() if self._take is not None else fresh(self.device)
        areas = [take(f"{self.name} slice {k}", shape) for k in range(min(2, len(bounds)))]
        with ThreadPoolExecutor(1, thread_name_prefix="porting-parity-vocab") as reader:

            def read(k: int):
                a, b = bounds[k]
                return reader.submit(self.rows, a, b, areas[k % 2][: b - a])

            pending = read(0)
            for k, (a, b) in enumerate(bounds):
                weight = pending.result()
                if k + 1 < len(bounds):
                    pending = read(k + 1)
                part = None if bias is None else bias[a:b]
                out[..., a:b] = F.linear(x, weight.to(x.dtype), part)
        return out

    def whole(self) -> torch.Tensor:
        """The table read whole (an operation the slices do not cover)."""
        if not WHOLE_ALLOWED:
            raise RuntimeError(
                f"{self.name}: the model used this vocabulary table in an operation the gate "
                "does not slice (an embedding lookup, F.linear or a matmul by its transpose); "
                "the gate would read it whole"
            )
        log.warning(
            "%s: the gate read this %d x %d table whole for an operation it does not slice",
            self.name,
            *self.shape,
        )
        return self.rows(0, self.shape[0])

    def __getitem__(self, index):
        if (
            isinstance(index, torch.Tensor)
            and not index.is_floating_point()
            and index.dtype != torch.bool
        ):
            return self.lookup(index)
        return self.whole()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and isinstance(_arg(args, kwargs, 1, "weight"), cls):
            if kwargs.get("max_norm") is not None or (len(args) > 3 and args[3] is not None):
                return _whole_call(func, args, kwargs)  # renormalises the rows it reads
            return _arg(args, kwargs, 1, "weight").lookup(_arg(args, kwargs, 0, "input"))
        if func is F.linear and isinstance(_arg(args, kwargs, 1, "weight"), cls):
            bias = _arg(args, kwargs, 2, "bias")
            if not isinstance(bias, cls):
                return _arg(args, kwargs, 1, "weight").product(_arg(args, kwargs, 0, "input"), bias)
        if func in _MATMULS and len(args) == 2 and not kwargs and isinstance(args[1], _Transposed):
            if isinstance(args[0], torch.Tensor):
                return args[1].table.product(args[0])
        return _whole_call(func, args, kwargs)


class _Transposed:
    """``table.t()``: what Megatron-Core's linear multiplies by (``torch.matmul(x, w.t())``)."""

    def __init__(self, table: VocabTable):
        self.table = table
        self.shape = torch.Size(reversed(table.shape))
        self.dtype = table.dtype
        self.device = table.device

    def t(self) -> VocabTable:
        return self.table

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return VocabTable.__torch_function__(func, types, args, kwargs)


_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})


def fresh(device: torch.device) -> Take:
    return lambda name, shape: torch.empty(shape, dtype=torch.float32, device=device)


def _arg(args, kwargs, i: int, name: str):
    return args[i] if len(args) > i else kwargs.get(name)


def _whole_call(func, args, kwargs):
    def real(a):
        if isinstance(a, VocabTable):
            return a.whole()
        if isinstance(a, _Transposed):
            return a.table.whole().t()
        if isinstance(a, (list, tuple)):
            return type(a)(real(b) for b in a)
        return a

    return func(*real(args), **{k: real(v) for k, v in kwargs.items()})


def install(module: torch.nn.Module, name: str, table: VocabTable) -> None:
    """Put ``table`` in place of ``module``'s parameter ``name`` (a plain attribute: the
    module's forward reads it as it read the parameter)."""
    module._parameters.pop(name, None)
    module.__dict__[name] = table


def install_tables(
    model: torch.nn.Module,
    modules: list[torch.nn.Module | None],
    vocab: int,
    make: Callable[[str, torch.Size], VocabTable],
) -> None:
    """A table made by ``make(name, shape)`` in place of each vocabulary table of ``modules``
    (:func:`vocab_tables`): one for a tied pair, in both places."""
    for key, places in vocab_tables(model, modules, vocab).items():
        shared = make(key, places[0][2])
        for module, pname, _ in places:
            install(module, pname, shared)


def vocab_tables(
    model: torch.nn.Module, modules: list[torch.nn.Module | None], vocab: int
) -> dict[str, list[tuple[torch.nn.Module, str, torch.Size]]]:
    """The parameters of ``modules`` (an embedding, an output layer; None passed over) that are
    vocabulary tables: two dimensions, ``vocab`` rows. Keyed by the parameter's name in
    ``model``; each ``(owner module, parameter name, shape)`` where it stands (a tied pair: one
    name, two places)."""
    names = {id(p): n for n, p in model.named_parameters()}
    found: dict[str, list] = {}
    seen = set()
    for module in modules:
        if module is None:
            continue
        for owner in module.modules():
            for pname, p in owner.named_parameters(recurse=False):
                if p.dim() != 2 or p.shape[0] != vocab or id(p) not in names:
                    continue
                if (id(owner), pname) not in seen:
                    seen.add((id(owner), pname))
                    found.setdefault(names[id(p)], []).append((owner, pname, p.shape))
    return found
