"""Module tensors set, listed and released by name: how the streamed gate loads a layer just
before it runs and frees it after (:mod:`porting.parity.streamed`, :mod:`porting.parity.mtp`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from functools import partial

import torch


def set_param(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    if leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def stored_tensors(
    module: torch.nn.Module, skip: tuple[str, ...] = (), matrices: bool | None = None
):
    """``(name, tensor)`` of what a checkpoint holds of ``module``: its parameters and its
    persistent buffers (a router's expert bias); none under the submodule prefixes ``skip``
    (``"mlp.experts."``). ``matrices``: True, only those of two or more dimensions; False, only
    the others (norms, biases, a router's expert bias, attention sinks)."""
    saved = set(module.state_dict(keep_vars=True))

    def kept(name: str, t: torch.Tensor) -> bool:
        if skip and name.startswith(skip):
            return False
        return matrices is None or (t.dim() >= 2) == matrices

    for name, t in module.named_parameters():
        if kept(name, t):
            yield name, t
    for name, t in module.named_buffers():
        if name in saved and kept(name, t):
            yield name, t


def expert_lists(layer: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """``(prefix, list)`` of the mixtures' experts in a decoder layer: each ``ModuleList`` of two
    or more modules of one class with parameters (HF's ``mlp.experts``, Megatron-Core's
    ``mlp.experts.local_experts``). Each expert runs as a module call, so the streamed gate can
    load it just before it runs and release it after: what one layer holds is then a bounded
    number of experts, not all of them."""
    found = []
    for name, module in layer.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        kinds = {type(m) for m in module}
        if len(kinds) == 1 and any(True for _ in module[0].parameters()):
            found.append((f"{name}.", module))
    return found


class ExpertStack:
    """Stands in, while the streamed gate runs, for a stacked expert parameter of transformers'
    model: transformers 5's (``mlp.experts.gate_up_proj`` ``(experts, 2 * ffn, hidden)``,
    ``down_proj`` ``(experts, hidden, ffn)``), whose eager experts loop indexes a stack one expert
    at a time (``self.gate_up_proj[expert_idx]``), or Llama 4's (``(experts, hidden, 2 * ffn)``,
    ``(experts, ffn, hidden)``), whose forward multiplies each stack whole
    (``torch.bmm(x, self.gate_up_proj)``). Each index here, and each expert's product in such a
    ``bmm``, reads that expert's slice alone, in fp32, freed once the product or the loop lets it
    go. So a layer's experts are in memory one at a time, as :func:`experts_streamed` keeps
    transformers 4's expert modules, and the model's own forward runs unchanged."""

    def __init__(self, shape: torch.Size, read: Callable[[int], torch.Tensor]):
        self.shape = torch.Size(shape)
        self.dtype = torch.float32
        self._read = read

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, expert) -> torch.Tensor:
        return self._read(int(expert))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        x, stack = args if len(args) == 2 else (None, None)
        if func is not torch.bmm or kwargs or not isinstance(stack, cls):
            raise TypeError(
                f"{getattr(func, '__name__', func)} on a streamed expert stack: the gate reads a "
                "stack one expert at a time, for a loop that indexes it or a torch.bmm with it"
            )
        # batch e of bmm is expert e's product: the same matrix product, one slice at a time
        return torch.stack([torch.mm(x[e], stack[e]) for e in range(len(stack))])


# the stacked expert parameters of a transformers 5 experts module; use_experts_implementation
# marks such a class with its stacks' layout (these flags), and its "eager" implementation is the
# class's own forward: a loop indexing each stack per expert, whatever the layout (gpt-oss's
# stacks are transposed, with bias stacks beside them)
_STACKS = ("gate_up_proj", "down_proj")
_LAYOUT_FLAGS = ("is_concatenated", "is_transposed", "has_bias")


def _streamable(module: torch.nn.Module) -> bool:
    """A module whose stacks :class:`ExpertStack` can stand in for: transformers 5's experts
    (run by their own eager loop), or a module holding the two stacks and at most their bias
    stacks, without that interface (Llama 4's ``Llama4TextExperts``, which multiplies them with
    ``torch.bmm``; transformers 4's gpt-oss, which loops over the experts on the CPU and uses
    ``torch.bmm`` elsewhere). A forward that does anything else with a stack fails naming it
    (:class:`ExpertStack`)."""
    if all(hasattr(module, flag) for flag in _LAYOUT_FLAGS):
        return True
    own = set(dict(module.named_parameters(recurse=False)))
    return set(_STACKS) <= own <= {*_STACKS, *(f"{n}_bias" for n in _STACKS)}


def stream_expert_stacks(
    layer: torch.nn.Module, read: Callable[[str, int, torch.Size], torch.Tensor]
) -> int:
    """Put an :class:`ExpertStack` in place of each stacked expert parameter of ``layer`` (a
    module that computes its experts one by one or by ``torch.bmm``, :func:`_streamable`);
    ``read(name, e, shape)`` reads expert ``e`` of the stack ``name`` (under ``layer``). A
    transformers 5 model must then run its experts eagerly
    (``set_experts_implementation("eager")``). Returns how many stacks."""
    count = 0
    for sub, module in layer.named_modules():
        stacks = [getattr(module, n, None) for n in _STACKS]
        if not all(isinstance(t, torch.nn.Parameter) and t.dim() == 3 for t in stacks):
            continue
        if not _streamable(module):
            continue
        for name, t in zip(_STACKS, stacks, strict=True):
            key = f"{sub}.{name}" if sub else name
            del module._parameters[name]
            module.__dict__[name] = ExpertStack(t.shape, partial(read, key, shape=t.shape[1:]))
            count += 1
    return count


def release(module: torch.nn.Module) -> None:
    """Put what was loaded of ``module`` (:func:`stored_tensors`: its parameters and persistent
    buffers) back on the meta device: frees their memory, and leaves no view of a reused buffer
    area behind (a router's expert bias would otherwise keep a whole area alive)."""
    for name, t in list(stored_tensors(module)):
        set_param(module, name, torch.empty(t.shape, dtype=t.dtype, device="meta"))


# ``load(i, sub, e, expert, read)``: the stored tensors of expert ``e`` of the list at ``sub``
# (``"mlp.experts."``) in layer ``i``; with ``read`` false, buffers of their shapes, unread.
ExpertLoad = Callable[[int, str, int, torch.nn.Module, bool], dict[str, torch.Tensor]]


@contextmanager
def experts_streamed(layers: Iterable[tuple[int, torch.nn.Module]], load: ExpertLoad) -> Iterator:
    """While inside, each expert of ``layers`` (:func:`expert_lists`) is loaded by ``load`` when
    the model calls it and released when it returns; expert ``e + 1`` of the same list is read on
    a thread while ``e`` computes. So a layer's experts are in memory two at a time, whatever
    their number. ``load`` alternates two buffer sets by ``e``'s parity."""
    reader = ThreadPoolExecutor(1, thread_name_prefix="porting-parity-expert")
    guessed: dict[tuple, Future] = {}
    handles = []

    def pre(module, args, i, sub, e, experts):
        future = guessed.pop((i, sub, e), None)
        # A wrong guess of which expert runs next (HF calls only the experts some position
        # chose) ends before its buffers can be taken again.
        for other in guessed.values():
            other.cancel()
        wait(list(guessed.values()))
        guessed.clear()
        if future is not None:
            params = future.result()
        else:
            # No position chose it (Megatron-Core calls every expert): nothing it returns depends
            # on its values, so none are read.
            empty = bool(args) and isinstance(args[0], torch.Tensor) and args[0].numel() == 0
            params = load(i, sub, e, module, not empty)
        for name, value in params.items():
            set_param(module, name, value)
        if e + 1 < len(experts):
            guessed[(i, sub, e + 1)] = reader.submit(load, i, sub, e + 1, experts[e + 1], True)

    for i, layer in layers:
        for sub, experts in expert_lists(layer):
            for e, expert in enumerate(experts):
                handles.append(
                    expert.register_forward_pre_hook(
                        lambda m, a, i=i, sub=sub, e=e, x=experts: pre(m, a, i, sub, e, x)
                    )
                )
                handles.append(expert.register_forward_hook(lambda m, a, o: release(m)))
    try:
        yield
    finally:
        unhook(handles, guessed.values(), reader)


def unhook(handles: Iterable, pending: Iterable[Future], reader: ThreadPoolExecutor) -> None:
    """Remove the forward hooks ``handles``, cancel the reads ``pending`` still queued and wait
    for ``reader``'s running one: after it no read lands in a buffer that is given back."""
    for h in handles:
        h.remove()
    for future in pending:
        future.cancel()
    reader.shutdown(wait=True)


def own_matrices(module: torch.nn.Module):
    """``(name, tensor)`` of the matrices (two or more dimensions) a checkpoint holds of
    ``module`` itself, none of its submodules'."""
    children = tuple(f"{name}." for name, _ in module.named_children())
    return stored_tensors(module, children, matrices=True)


def pieces(layer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(prefix, module)`` of each module below ``layer`` that holds matrices of its own (a
    linear layer, a router), outside the mixtures' experts (:func:`expert_lists`, streamed by
    :func:`experts_streamed`). A model may use a module's vectors outside its call
    (transformers' DeepSeek-V3 reads its router's expert bias after the router returns), its
    matrices only in it; so the vectors stay with the layer."""
    experts = tuple(prefix for prefix, _ in expert_lists(layer))
    out = []
    for name, module in layer.named_modules():
        if not name or (experts and f"{name}.".startswith(experts)):
            continue
        if any(True for _ in own_matrices(module)):
            out.append((f"{name}.", module))
    return out


# ``load(i, sub, module, take)``: the matrices of ``module`` itself (:func:`own_matrices`), found
# at ``sub`` (``"mlp.down_proj."``) in layer ``i``, each read into ``take(name, shape)``
PieceLoad = Callable[..., dict[str, torch.Tensor]]
# A piece's matrices are read into one of two areas that the pieces reuse (a fresh 180 MB buffer,
# a 7B's gate projection in fp32, is 45,000 page faults): an area holds the largest piece up to
# this, and a larger piece (DeepSeek-V3's fused dense gate-and-up, 1.06 GB) has memory of its own.
PIECE_AREA_BYTES = 512 << 20


def _fresh(device: torch.device) -> Callable[[str, torch.Size], torch.Tensor]:
    return lambda name, shape: torch.empty(shape, dtype=torch.float32, device=device)


class _PieceAreas:
    """Two fp32 areas, each lent to one piece's read until that piece is released; a read when
    both are lent, or larger than an area, gets memory of its own."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel, self.device = numel, device
        self._areas: list[torch.Tensor | None] = [None, None]
        self._lent: list[object | None] = [None, None]
        self._lock = threading.Lock()

    def take(self, token: object, numel: int) -> Callable[[str, torch.Size], torch.Tensor]:
        with self._lock:
            k = next((k for k in (0, 1) if self._lent[k] is None), None)
            if k is None or numel > self.numel:
                return _fresh(self.device)
            self._lent[k] = token
        if self._areas[k] is None:
            self._areas[k] = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        area, at = self._areas[k], [0]

        def carve(name: str, shape: torch.Size) -> torch.Tensor:
            start, at[0] = at[0], at[0] + shape.numel()
            return area[start : at[0]].view(shape)

        return carve

    def give_back(self, token: object) -> None:
        with self._lock:
            self._lent = [None if t is token else t for t in self._lent]


class StoredMatrix:
    """Stands in, between its module's calls, for a matrix of a layer read by pieces
    (:func:`pieces_streamed`). Its shape, dtype and device answer at once; anything else done
    with it reads it from storage first, for that one use: a model may multiply by a module's
    matrix without calling the module (transformers 5's DeepSeek-V2 reads its router's weight
    so), which must compute what the model computes, not fail or read nothing."""

    requires_grad = False
    is_meta = False

    def __init__(
        self, shape: torch.Size, dtype: torch.dtype, device, read: Callable[[], torch.Tensor]
    ):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)
        self._read = read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._read(), name)

    def __getitem__(self, index):
        return self._read()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(a):
            if isinstance(a, cls):
                return a._read()
            if isinstance(a, (list, tuple)):
                return type(a)(real(b) for b in a)
            return a

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})


def _binary(name: str):
    return lambda self, other: getattr(self._read(), name)(other)


for _name in ("__matmul__", "__rmatmul__", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__"):
    setattr(StoredMatrix, _name, _binary(_name))


def _shadow(module: torch.nn.Module) -> torch.nn.Module:
    """A module holding meta copies of ``module``'s own matrices under their names (persistent
    buffers as such): what a piece's load enumerates, on the reading thread, while the model's
    own module stands in for its matrices on the computing one."""
    shadow = torch.nn.Module()
    saved = set(module.state_dict(keep_vars=True))
    for name, t in own_matrices(module):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        if name in module._buffers:
            shadow.register_buffer(name, meta, persistent=name in saved)
        else:
            shadow.register_parameter(name, torch.nn.Parameter(meta, requires_grad=False))
    return shadow


@contextmanager
def pieces_streamed(
    layers: Iterable[tuple[int, torch.nn.Module]], load: PieceLoad, device: torch.device
) -> Iterator:
    """While inside, the matrices of each piece of ``layers`` (:func:`pieces`) are loaded by
    ``load`` before the model calls it and released when it returns: a layer's matrices are in
    memory a module at a time (one and those it is called inside of) plus the next one, read on
    a thread while this one computes, for a layer too large to hold two of. The next is the one
    called after this module in the layer before, else the next in the modules' order not yet
    called nor guessed wrong in this layer; a read for a module not called next is dropped (a
    first layer's cost, while its order is learned). The reads go to two reused areas
    (:data:`PIECE_AREA_BYTES`). Between calls each matrix is a :class:`StoredMatrix`. Its vectors
    are read with the layer."""
    stream = _PieceStream(layers, load, device)
    stream.install()
    try:
        yield
    finally:
        stream.close()


class _PieceStream:
    """The state of :func:`pieces_streamed`: each piece's matrices as built, the order the
    pieces are called in, the read ahead."""

    def __init__(self, layers, load: PieceLoad, device: torch.device) -> None:
        self.load, self.device = load, device
        self.handles: list = []
        # module -> its own matrices' (name, shape, dtype, a buffer), as built
        self.matrices: dict[torch.nn.Module, list[tuple[str, torch.Size, torch.dtype, bool]]] = {}
        self.shadows: dict[torch.nn.Module, torch.nn.Module] = {}
        self.lent: dict[torch.nn.Module, object] = {}  # the token of the area a loaded piece holds
        # (layer, prefix) -> its module, in the order the layers run; what followed each prefix
        self.order: list[tuple[int, str]] = []
        self.modules: dict[tuple[int, str], torch.nn.Module] = {}
        self.follows: dict[str, str] = {}
        self.called: dict[int, list[str]] = {}
        self.missed: set[tuple[int, str]] = set()
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="porting-parity-piece")
        self.ahead: dict[tuple[int, str], Future] = {}
        for i, layer in layers:
            for sub, module in pieces(layer):
                self.matrices[module] = [
                    (name, t.shape, t.dtype, name in module._buffers)
                    for name, t in own_matrices(module)
                ]
                self.shadows[module] = _shadow(module)
                self.order.append((i, sub))
                self.modules[i, sub] = module
        sizes = [sum(shape.numel() for _, shape, _, _ in m) for m in self.matrices.values()]
        self.areas = _PieceAreas(min(max(sizes, default=0), PIECE_AREA_BYTES // 4), device)

    def install(self) -> None:
        """Every piece stands for its matrices, and is loaded when called."""
        for (i, sub), module in self.modules.items():
            self.stand(module, i, sub)
            self.handles.append(
                module.register_forward_pre_hook(lambda m, a, i=i, sub=sub: self.pre(m, i, sub))
            )
            self.handles.append(
                module.register_forward_hook(lambda m, a, o, i=i, sub=sub: self.stand(m, i, sub))
            )

    def close(self) -> None:
        """The hooks removed, the reads ahead ended, every module as built."""
        for h in self.handles:
            h.remove()
        for future in self.ahead.values():
            future.cancel()
        self.reader.shutdown(wait=True)
        self.ahead.clear()
        for module in self.matrices:
            self.as_built(module)

    def as_built(self, module) -> None:
        for name, shape, dtype, buffer in self.matrices[module]:
            module.__dict__.pop(name, None)
            meta = torch.empty(shape, dtype=dtype, device="meta")
            if buffer:
                module._buffers[name] = meta
            else:
                set_param(module, name, meta)

    def read(self, module, i, sub, token=None) -> dict[str, torch.Tensor]:
        """The piece's matrices, in an area lent to ``token`` (none: memory of their own)."""
        if token is None:
            return self.load(i, sub, self.shadows[module], _fresh(self.device))
        numel = sum(shape.numel() for _, shape, _, _ in self.matrices[module])
        return self.load(i, sub, self.shadows[module], self.areas.take(token, numel))

    def stand(self, module, i, sub) -> None:
        """The piece's matrices released: each a :class:`StoredMatrix` until called again."""
        self.areas.give_back(self.lent.pop(module, None))
        for name, shape, dtype, _ in self.matrices[module]:
            module._parameters.pop(name, None)
            module._buffers.pop(name, None)
            module.__dict__[name] = StoredMatrix(
                shape, dtype, self.device, lambda n=name: self.read(module, i, sub)[n]
            )

    def after(self, i: int, sub: str) -> tuple[int, str] | None:
        """The piece expected to be called after ``sub`` of layer ``i``: the one that followed
        it in a layer before, else the next not yet called in the modules' order (the next
        layer's first)."""
        if sub in self.follows and (i, self.follows[sub]) in self.modules:
            return i, self.follows[sub]
        here = [
            p for p in self.order
            if p[0] == i and p[1] not in self.called[i] and p not in self.missed
        ]  # fmt: skip
        if here:
            return here[0]
        j = next((p[0] for p in self.order if p[0] > i), None)
        if j is None:
            return None
        first = next(iter(self.called.values()))[0]  # what the first layer began with
        if (j, first) in self.modules:
            return j, first
        return next(p for p in self.order if p[0] == j)

    def pre(self, module, i, sub) -> None:
        """Before the piece runs: its matrices in place (read ahead, or now), the next read."""
        if self.called.get(i):
            self.follows[self.called[i][-1]] = sub
        self.called.setdefault(i, []).append(sub)
        future = self.ahead.pop((i, sub), None)
        for key, dropped in self.ahead.items():  # a read for another piece, not called next:
            dropped.add_done_callback(lambda f: self.areas.give_back(f.token))  # area back once
            self.missed.add(key)  # done, and not guessed again for its layer
        self.ahead.clear()
        if future is None:
            self.lent[module] = object()
            values = self.read(module, i, sub, self.lent[module])
        else:
            self.lent[module] = future.token
            values = future.result()
        for name, _, _, buffer in self.matrices[module]:
            module.__dict__.pop(name, None)
            if buffer:
                module._buffers[name] = values[name]
            else:
                set_param(module, name, values[name])
        nxt = self.after(i, sub)
        if nxt is not None:
            token = object()
            self.ahead[nxt] = self.reader.submit(self.read, self.modules[nxt], *nxt, token)
            self.ahead[nxt].token = token
