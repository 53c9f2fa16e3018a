"""Module tensors set, listed and released by name: how the streamed gate loads a layer just
before it runs and frees it after (:mod:`porting.parity.streamed`, :mod:`porting.parity.mtp`)."""

from __future__ import annotations

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
        for h in handles:
            h.remove()
        for future in guessed.values():
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


# ``load(i, sub, module)``: the matrices of ``module`` itself (:func:`own_matrices`), found at
# ``sub`` (``"mlp.down_proj."``) in layer ``i``
PieceLoad = Callable[[int, str, torch.nn.Module], dict[str, torch.Tensor]]


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


@contextmanager
def pieces_streamed(
    layers: Iterable[tuple[int, torch.nn.Module]], load: PieceLoad, device: torch.device
) -> Iterator:
    """While inside, the matrices of each piece of ``layers`` (:func:`pieces`) are loaded by
    ``load`` when the model calls it and released when it returns: a layer's matrices are in
    memory a module at a time (one and those it is called inside of), for a layer too large to
    hold two of. Between calls each is a :class:`StoredMatrix`. Its vectors are read with the
    layer."""
    handles = []
    # module -> its own matrices' (name, shape, dtype, a buffer), as built
    matrices: dict[torch.nn.Module, list[tuple[str, torch.Size, torch.dtype, bool]]] = {}

    def as_built(module):
        for name, shape, dtype, buffer in matrices[module]:
            module.__dict__.pop(name, None)
            meta = torch.empty(shape, dtype=dtype, device="meta")
            if buffer:
                module._buffers[name] = meta
            else:
                set_param(module, name, meta)

    def read(module, i, sub) -> dict[str, torch.Tensor]:
        as_built(module)  # what load enumerates: the module's stored tensors
        return load(i, sub, module)

    def stand(module, i, sub):
        for name, shape, dtype, _ in matrices[module]:
            module._parameters.pop(name, None)
            module._buffers.pop(name, None)
            module.__dict__[name] = StoredMatrix(
                shape, dtype, device, lambda n=name: one(read(module, i, sub), n, module, i, sub)
            )

    def one(values, name, module, i, sub):
        stand(module, i, sub)  # read() put the module as built: it stands in again
        return values[name]

    def pre(module, args, i, sub):
        values = read(module, i, sub)
        for name, _, _, buffer in matrices[module]:
            if buffer:
                module._buffers[name] = values[name]
            else:
                set_param(module, name, values[name])

    def post(module, args, output, i, sub):
        stand(module, i, sub)

    for i, layer in layers:
        for sub, module in pieces(layer):
            matrices[module] = [
                (name, t.shape, t.dtype, name in module._buffers)
                for name, t in own_matrices(module)
            ]
            stand(module, i, sub)
            handles.append(
                module.register_forward_pre_hook(lambda m, a, i=i, sub=sub: pre(m, a, i, sub))
            )
            handles.append(
                module.register_forward_hook(lambda m, a, o, i=i, sub=sub: post(m, a, o, i, sub))
            )
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module in matrices:
            as_built(module)
