"""One side of the streamed gate (:mod:`porting.parity.streamed`): the reference model or
Megatron's, built on meta, each decoder layer read just before it runs and released after it
(:class:`Side`), into two areas the layers use in turn (:class:`Buffers`); a layer too large
for that read a module at a time (:func:`_by_pieces`); over the ranks of a conversion, this
process's share of the pipeline (:class:`Stage`). What a side reads and how the two are compared
is the gate's (:mod:`porting.parity.streamed`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.overrides import TorchFunctionMode

from porting.convert.preflight import GATE_LAYER_BYTES
from porting.errors import PortingError
from porting.parity.modules import (
    expert_lists,
    experts_streamed,
    pieces_streamed,
    release,
    set_param,
    stored_tensors,
    unhook,
)
from porting.parity.vocab import VocabTable

# A decoder layer whose own tensors (not its experts') hold more than this in fp32 is read a
# module's matrices at a time, the next module's while one computes (porting.parity.modules.
# pieces_streamed), not whole and two at a time: two of DeepSeek-V3's MoE layers without their
# experts (0.93 GB each) or of its dense layers (2.3 GB) would otherwise be the gate's peak. The
# gate's memory bound counts it (preflight.gate_memory).
LAYER_BYTES = GATE_LAYER_BYTES


def check_shape(where: str, key: str, got: torch.Size, want: torch.Size) -> None:
    if tuple(got) != tuple(want):
        raise PortingError(
            f"{where}: tensor {key!r} has shape {tuple(got)}, the config implies {tuple(want)}"
        )


def layer_list(
    model: torch.nn.Module, num_layers: int, under: str = ""
) -> tuple[str, torch.nn.ModuleList]:
    """The model's one ``ModuleList`` of ``num_layers`` decoder layers, and its name (``under``:
    only inside that submodule, a container's language model)."""
    root = model.get_submodule(under) if under else model
    found = [
        (f"{under}.{n}" if under else n, m)
        for n, m in root.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers
    ]
    if len(found) != 1:
        raise PortingError(
            f"cannot tell the decoder layers of {type(model).__name__} "
            f"({len(found)} module lists of {num_layers} layers)"
        )
    return found[0]


def output_of(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class Handoff(Exception):
    """Raised after a stage's last layer: the rest of the model is the next stage's."""


@dataclass
class Stage:
    """This process's share of a gate split over the ranks of a conversion: a pipeline.

    Rank ``r`` of ``k`` runs the contiguous layers ``owned`` of both sides: it takes the hidden
    state its predecessor's last layer made, runs its own, and hands the result on; the last
    stage runs the head. Every layer is computed exactly as in one process (its input is the
    same tensor, passed whole), so the verdict is one process's, and each rank reads only its
    layers' tensors. Ranks beyond the number of layers take no part in the passes.
    """

    rank: int
    stages: int
    owned: range

    @classmethod
    def of_this_process(cls, num_layers: int) -> Stage | None:
        """The stage of this rank, or None outside a multi-process conversion."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        rank, stages = dist.get_rank(), min(dist.get_world_size(), num_layers)
        if rank >= stages:
            return cls(rank, stages, range(0))
        return cls(
            rank, stages, range(rank * num_layers // stages, (rank + 1) * num_layers // stages)
        )

    @property
    def last(self) -> bool:
        return self.rank == self.stages - 1

    def receive(self, like: torch.Tensor) -> torch.Tensor:
        got = torch.empty(like.shape, dtype=like.dtype)
        torch.distributed.recv(got, src=self.rank - 1)
        return got.to(like.device)

    def send(self, t: torch.Tensor) -> None:
        torch.distributed.send(t.detach().contiguous().cpu(), dst=self.rank + 1)

    @contextmanager
    def only_owned(self, model: torch.nn.Module, layers: torch.nn.ModuleList):
        """The model's layer list cut to this stage's layers for the block (the model's own
        forward then runs only those: embeddings, then the owned layers, then the head)."""
        name = next(n for n, m in model.named_modules() if m is layers)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, torch.nn.ModuleList([layers[i] for i in self.owned]))
        try:
            yield
        finally:
            setattr(parent, attr, layers)


class Buffers:
    """Two fp32 areas on ``device``, used in turn by consecutive layers, and by both models.

    Layer ``i`` computes in area ``i % 2`` while layer ``i + 1`` is read into the other. Reusing
    them costs no fresh pages: a new 800 MB buffer (a 7B layer in fp32) is 200,000 page faults,
    and freeing it an unmap. The Megatron model's layers take the areas the HF model's used
    (:meth:`reserve`), and the output layer's slices, which run while no layer is loaded, take
    area 0 (:meth:`spare`). Without :meth:`reserve` (an expert's tensors) each name keeps a buffer of its own.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._numel = 0
        self._areas: list[torch.Tensor | None] = [None, None]
        self.clear()

    def reserve(self, numel: int) -> None:
        """A model whose layers hold up to ``numel`` values each takes the areas (each made when
        first used, so that an embedding larger than a layer is not read beside them)."""
        self.clear()
        if numel > self._numel:
            self._areas = [None, None]
        self._numel = max(numel, self._numel)

    def _area(self, k: int) -> torch.Tensor | None:
        if self._areas[k] is None and self._numel:
            self._areas[k] = torch.empty(self._numel, dtype=torch.float32, device=self.device)
        return self._areas[k]

    def take(self, layer: int, name: str, shape: torch.Size) -> torch.Tensor:
        """The buffer for parameter ``name`` of ``layer`` (the same one for every layer of its
        parity, while its shape is the same)."""
        k = layer % 2
        buffers = self._sets[k]
        buf = buffers.get(name)
        if buf is None or buf.shape != shape:
            buf = buffers[name] = self._carve(k, shape)
        return buf

    def _carve(self, k: int, shape: torch.Size) -> torch.Tensor:
        area, start = self._area(k), self._next[k]
        if area is None or start + shape.numel() > area.numel():
            return torch.empty(shape, dtype=torch.float32, device=self.device)
        self._next[k] = start + shape.numel()
        return area[start : start + shape.numel()].view(shape)

    def spare(self) -> Take:
        """What an operation between the layers (a vocabulary table's slices,
        :mod:`porting.parity.vocab`) computes in: area 0 where it is made and no layer holds it;
        otherwise memory of its own (an area is not made for it: it may be far larger)."""
        offset = [0]

        def take(name: str, shape: torch.Size) -> torch.Tensor:
            area, start = self._areas[0], offset[0]
            if area is not None and not self._sets[0] and start + shape.numel() <= area.numel():
                offset[0] = start + shape.numel()
                return area[start : start + shape.numel()].view(shape)
            return torch.empty(shape, dtype=torch.float32, device=self.device)

        return take

    def clear(self) -> None:
        """Forget the buffers handed out (their layers are released); the areas stay."""
        self._sets: tuple[dict, dict] = ({}, {})
        self._next = [0, 0]

    def free(self) -> None:
        """Free the areas too (made again when next used)."""
        self.clear()
        self._areas = [None, None]


def cast_into(buf: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` (any float dtype, on the host) into ``buf``, cast on ``buf``'s device."""
    if buf.device.type == "cpu":
        buf.copy_(value)
    else:  # send the stored dtype (half the bytes of fp32), cast where it lands
        buf.copy_(value.to(buf.device))


# What a module's tensors are read into: ``take(name, shape)`` gives the buffer.
Take = Callable[[str, torch.Size], torch.Tensor]


@dataclass
class Side:
    """One model with streamed layers: hooks load layer ``i`` before it runs, release it after;
    inside a layer, each expert of a mixture the same (:func:`expert_lists`)."""

    model: torch.nn.Module
    layers: torch.nn.ModuleList
    # ``load(i, sub, module, take, skip, matrices=None)``: the stored tensors of ``module``,
    # found at ``sub`` (``""``, ``"mlp.experts.3."``) in layer ``i``, none under the prefixes
    # ``skip`` (``matrices``: only those of two or more dimensions, or only the others)
    load: Callable[..., dict[str, torch.Tensor]]
    # HF: ``read(key, shape)``, one tensor by name, in fp32 (shape None: as stored); Megatron:
    # ``read(name, skip)``, the tensors of the submodule ``name`` (none under the prefixes
    # ``skip``). For what is not a decoder layer (the MTP layers).
    read: Callable | None = None
    buffers: Buffers | None = None
    expert_buffers: Buffers | None = None
    # HF, past the decoder: ``read_expert(key, e, shape)``, expert ``e`` of a transformers 5
    # stack (:class:`~porting.parity.modules.ExpertStack`); ``table(key)``, a vocabulary table
    # (:class:`~porting.parity.vocab.VocabTable`) of a stored tensor, an MTP layer's own embedding
    read_expert: Callable | None = None
    table: Callable[[str], VocabTable] | None = None
    # the layers read a module's matrices at a time in the current run (_by_pieces)
    by_pieces: set[int] = field(default_factory=set)

    def load_layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s tensors but its experts'; of a layer read by pieces
        (:func:`_by_pieces`), only its vectors (norms, biases: its matrices are read when their
        modules are called)."""
        layer = self.layers[i]
        skip = tuple(prefix for prefix, _ in expert_lists(layer))
        matrices = False if i in self.by_pieces else None
        return self.load(i, "", layer, partial(self.buffers.take, i), skip, matrices)

    def load_piece(
        self, i: int, sub: str, module: torch.nn.Module, take: Take
    ) -> dict[str, torch.Tensor]:
        """The matrices of ``module`` itself, at ``sub`` in layer ``i``, read into ``take``
        (:func:`~porting.parity.modules.pieces_streamed`'s areas)."""
        skip = tuple(f"{name}." for name, _ in module.named_children())
        return self.load(i, sub, module, take, skip, True)

    @torch.no_grad()
    def run(
        self, call: Callable[[], torch.Tensor], on_layer, stage: Stage | None = None
    ) -> torch.Tensor | None:
        """``call()`` with every layer streamed; ``on_layer(i, layer, args, kwargs, output)``
        after each. Layer ``i + 1`` is read on a thread while layer ``i`` computes, and expert
        ``e + 1`` on another while expert ``e`` computes: a layer's experts are in memory two at
        a time, whatever their number. With a ``stage``, only its layers run (the first on the
        hidden state the previous stage sends); a stage but the last returns None after sending
        its last layer's output on."""
        owned = stage.owned if stage is not None else range(len(self.layers))
        if not owned:
            return None
        n = owned.stop
        reader = ThreadPoolExecutor(1, thread_name_prefix="porting-parity-read")
        pending: dict[int, Future] = {}
        handles = []

        def pre(mod, args, kwargs, i):
            future = pending.pop(i, None)
            params = future.result() if future is not None else self.load_layer(i)
            for name, value in params.items():
                set_param(mod, name, value)
            if i + 1 < n:  # its buffers are those of layer i - 1, released already
                pending[i + 1] = reader.submit(self.load_layer, i + 1)
            if i == owned.start and stage is not None and stage.rank > 0:
                if args:  # HF passes the hidden state by position, Megatron by name
                    return (stage.receive(args[0]), *args[1:]), kwargs
                return args, dict(kwargs, hidden_states=stage.receive(kwargs["hidden_states"]))
            return None

        def post(mod, args, kwargs, output, i):
            on_layer(i, mod, args, kwargs, output_of(output))
            release(mod)
            if i == n - 1:  # what runs after them (the output layer) takes their areas (spare())
                for buffers in (self.buffers, self.expert_buffers):
                    if buffers is not None:
                        buffers.clear()
                if stage is not None and not stage.last:
                    stage.send(output_of(output))
                    raise Handoff

        def load_expert(i, sub, e, module, read):
            take = partial(self.expert_buffers.take, e)
            if not read:
                return {name: take(name, p.shape) for name, p in stored_tensors(module)}
            return self.load(i, f"{sub}{e}.", module, take, ())

        for i in owned:
            layer = self.layers[i]
            handles.append(
                layer.register_forward_pre_hook(
                    lambda m, a, k, i=i: pre(m, a, k, i), with_kwargs=True
                )
            )
            handles.append(
                layer.register_forward_hook(
                    lambda m, a, k, o, i=i: post(m, a, k, o, i), with_kwargs=True
                )
            )

        cut = stage.only_owned(self.model, self.layers) if stage is not None else nullcontext()
        # decided before the pieces' matrices stand in for themselves (no longer parameters)
        self.by_pieces = {i for i in owned if _by_pieces(self.layers[i])}
        by_pieces = [(i, self.layers[i]) for i in sorted(self.by_pieces)]
        try:
            with (
                cut,
                experts_streamed(((i, self.layers[i]) for i in owned), load_expert),
                pieces_streamed(by_pieces, self.load_piece, self.buffers.device),
            ):
                return call()
        except Handoff:
            return None
        finally:
            unhook(handles, pending.values(), reader)
            for buffers in (self.buffers, self.expert_buffers):
                if buffers is not None:
                    buffers.clear()


def layer_numel(layers: torch.nn.ModuleList) -> int:
    """The most values one layer's tensors read with it hold: its own but its experts', or of a
    layer read by pieces (:func:`_by_pieces`) the layer's own only."""
    return max((_read_with(layer) for layer in layers), default=0)


def _read_with(layer: torch.nn.Module) -> int:
    return _whole_numel(layer, False if _by_pieces(layer) else None)


def _whole_numel(layer: torch.nn.Module, matrices: bool | None = None) -> int:
    skip = tuple(p for p, _ in expert_lists(layer))
    return sum(t.numel() for _, t in stored_tensors(layer, skip, matrices))


def _by_pieces(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is read a module at a time (:data:`LAYER_BYTES`)."""
    return 4 * _whole_numel(layer) > LAYER_BYTES


class LargeOnMeta(TorchFunctionMode):
    """While a model is built with ``init_empty_weights`` (each parameter moved to meta once
    registered, buffers left real), a tensor made by a factory call (``torch.zeros``, ``ones``,
    ``full``, ``empty``, ``rand``/``randn``) of more than :attr:`BYTES` is made on meta at once.
    transformers 5's Llama 4 fills each layer's expert stack with ``torch.zeros`` before
    registering it: 5.4 GB touched and dropped per Scout layer, 43 GB per Maverick layer, which
    would be the gate's peak or kill it. What a model keeps real (rotary frequencies, ALiBi slopes,
    a causal mask) is kilobytes to a few megabytes."""

    BYTES = 64 << 20
    _FACTORIES = frozenset(
        {torch.zeros, torch.ones, torch.full, torch.empty, torch.rand, torch.randn}
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._FACTORIES and kwargs.get("device") is None:
            size = kwargs.get("size", args[0] if args and not isinstance(args[0], int) else args)
            if isinstance(size, (tuple, list, torch.Size)) and all(
                isinstance(d, int) for d in size
            ):
                dtype = kwargs.get("dtype") or torch.get_default_dtype()
                if torch.Size(size).numel() * dtype.itemsize > self.BYTES:
                    kwargs["device"] = "meta"
        return func(*args, **kwargs)


def to_device(model: torch.nn.Module, device: torch.device) -> None:
    """Move what the model computes with besides its parameters (buffers, and tensors kept as
    plain attributes: rotary frequencies, ALiBi slopes) to ``device``."""
    if device.type == "cpu":
        return  # built there
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type != "meta":
                module._buffers[name] = buf.to(device)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                if value.device.type != "meta":
                    setattr(module, name, value.to(device))
