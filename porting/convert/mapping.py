"""The engine side of a weight mapping: plan, produce and account for every tensor.

A family's table is declared with :mod:`porting.contract.mapping`'s entries; this module applies
it. Completeness is accounted both ways: every source key is consumed exactly once and every
target parameter is written exactly once, with shape and dtype checked and the offending key
named in the error.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from porting.contract.mapping import (
    Concrete,
    Entry,
    Ignore,
    expand,
    resolve_target_names,
    stacked_part,
    stored_key,
)
from porting.errors import PortingError

log = logging.getLogger(__name__)


class TensorSource(Protocol):
    """What the engine needs of a checkpoint reader: key listing, header facts, and one-tensor reads."""

    def keys(self) -> list[str]: ...

    def get(self, key: str) -> torch.Tensor: ...


@dataclass
class ImportReport:
    """What an import consumed and wrote; returned for logging and tests."""

    consumed: int = 0
    ignored: list[str] = field(default_factory=list)
    written: int = 0


def plan_import(
    entries: list[Concrete], ignores: list[Ignore], source_keys: Iterable[str]
) -> tuple[list[Concrete], list[str]]:
    """Check that every source key is claimed exactly once; return entries and ignored keys.

    Raises :class:`PortingError` naming unknown keys, keys claimed twice and keys the table needs
    but the checkpoint lacks.
    """
    source = list(source_keys)
    source_set = set(source)
    claimed: dict[str, str] = {}
    for c in entries:
        for k in c.hf:
            if k in claimed:
                raise PortingError(f"mapping table claims source key {k!r} twice")
            claimed[k] = c.mcore
    # a stacked tensor is claimed by its slices (``name[#]``)
    stored = {stored_key(k) for k in claimed}
    missing = list(dict.fromkeys(stored_key(k) for c in entries for k in c.hf))
    missing = [k for k in missing if k not in source_set]
    ignored, unknown = [], []
    for k in source:
        if k in stored:
            continue
        if any(fnmatch.fnmatchcase(k, i.hf) for i in ignores):
            ignored.append(k)
        else:
            unknown.append(k)
    if unknown:
        raise PortingError(
            f"{len(unknown)} checkpoint key(s) are not in the mapping table: "
            + ", ".join(repr(k) for k in unknown[:10])
            + (" ..." if len(unknown) > 10 else "")
            + " (refusing to drop weights silently)"
        )
    if missing:
        raise PortingError(
            f"{len(missing)} key(s) the model needs are missing from the checkpoint: "
            + ", ".join(repr(k) for k in missing[:10])
            + (" ..." if len(missing) > 10 else "")
        )
    return entries, ignored


def produce(
    c: Concrete, source: TensorSource, ctx: Any, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The Megatron tensor of entry ``c``: its HF tensors read and transformed, shape and dtype
    checked against the model's ``shape`` and ``dtype``."""
    tensors = [source.get(k) for k in c.hf]
    try:
        value = c.transform.forward(*tensors, ctx)
    except (PortingError, RuntimeError, ValueError, IndexError) as err:
        # A transform fails on tensors whose shapes do not fit the config (a reshape to the
        # wrong head count, say): name the parameter and every input with its shape.
        inputs = ", ".join(f"{k} {tuple(t.shape)}" for k, t in zip(c.hf, tensors, strict=True))
        raise PortingError(
            f"cannot build {c.mcore!r} (model expects {tuple(shape)}) "
            f"with {c.transform.name} from {inputs}: {err}"
        ) from err
    if tuple(value.shape) != tuple(shape):
        raise PortingError(
            f"shape mismatch for {c.mcore!r} (from {', '.join(c.hf)}): checkpoint gives "
            f"{tuple(value.shape)}, model expects {tuple(shape)}"
        )
    if value.dtype != dtype:
        raise PortingError(
            f"dtype mismatch for {c.mcore!r} (from {', '.join(c.hf)}): checkpoint has "
            f"{value.dtype}, model has {dtype}"
        )
    return value


def import_weights(
    source: TensorSource,
    target: Mapping[str, torch.Tensor],
    table: Iterable[Entry],
    ctx: Any,
    num_layers: int,
    progress: Callable[[int], Any] | None = None,
) -> ImportReport:
    """Fill the Megatron parameters ``target`` (name -> tensor) from ``source``, entry by entry.

    Every target parameter must be written exactly once and its shape and dtype must match. The
    streamed import does not fill a model: its writer calls a :class:`WeightProducer` instead.
    """
    producer = WeightProducer(source, target, table, ctx, num_layers, progress)
    for name in list(producer.entries):
        value = producer(name)
        dest = target[name]
        with torch.no_grad():
            if isinstance(dest, torch.nn.Parameter):
                # Adopt the produced tensor instead of copying it into the parameter.
                dest.data = value
            else:
                dest.copy_(value)
        del value
    return producer.finish()


def export_owners(
    table: Iterable[Entry],
    ctx: Any,
    num_layers: int,
    mcore_keys: Iterable[str],
    nbytes: Mapping[str, int],
    ranks: int,
) -> dict[str, int]:
    """Which of ``ranks`` ranks makes each HF tensor of an export (``nbytes``: each HF tensor's
    size): the tensors that one table entry makes, or that are slices of one stacked tensor, go
    together, and the groups are dealt largest first to the rank with the fewest bytes so far.
    The same on every rank (a function of the table and the sizes only)."""
    entries, _ = expand(table, ctx, num_layers)
    entries = resolve_target_names(entries, list(mcore_keys))
    group: dict[str, str] = {}  # union-find over the stored HF keys an entry touches

    def find(k: str) -> str:
        while group.setdefault(k, k) != k:
            k = group[k]
        return k

    for c in entries:
        stored = [stored_key(k) for k in c.hf]
        for k in stored[1:]:
            group[find(k)] = find(stored[0])
        find(stored[0])
    members: dict[str, list[str]] = {}
    for k in group:
        members.setdefault(find(k), []).append(k)
    load = [0] * ranks
    owner: dict[str, int] = {}
    units = sorted(members.values(), key=lambda ks: (-sum(nbytes[k] for k in ks), min(ks)))
    for keys in units:
        rank = min(range(ranks), key=lambda r: (load[r], r))
        load[rank] += sum(nbytes[k] for k in keys)
        owner.update(dict.fromkeys(keys, rank))
    return owner


def export_weights(
    source: Mapping[str, torch.Tensor],
    table: Iterable[Entry],
    ctx: Any,
    num_layers: int,
    keep: Callable[[str], bool] | None = None,
    stack: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, tensor)`` pairs derived from Megatron parameters through the inverse table.

    Every Megatron parameter must be used exactly once; an unused one is an error (it would be lost).
    ``keep``: only the entries whose (stored) HF tensor it keeps are read and made (a rank's share
    of a launched export, :func:`export_owners`); the checks above still cover the whole table.
    ``stack=False``: the slices of a stacked HF tensor are yielded as they are made, under their
    slice keys (``name[i]``), for a writer that puts each into its place in the stack; else each
    stacked tensor is yielded whole once its last slice is made.
    """
    entries, _ = expand(table, ctx, num_layers)
    entries = resolve_target_names(entries, source.keys())
    used = {c.mcore for c in entries}
    missing = [c.mcore for c in entries if c.mcore not in source]
    if missing:
        raise PortingError(
            "the NeMo checkpoint lacks parameter(s) the mapping needs: "
            + ", ".join(repr(k) for k in missing[:10])
        )
    left = sorted(set(source) - used)
    if left:
        raise PortingError(
            f"{len(left)} Megatron parameter(s) have no HF destination in the mapping table: "
            + ", ".join(repr(k) for k in left[:10])
        )
    # each stacked tensor is yielded once its last slice is made, its slices in index order
    parts: dict[str, dict[int, torch.Tensor]] = {}
    count: dict[str, int] = {}
    for c in entries:
        for k in c.hf:
            if (part := stacked_part(k)) is not None:
                count[part[0]] = count.get(part[0], 0) + 1
    if keep is not None:
        entries = [c for c in entries if keep(stored_key(c.hf[0]))]
    for c in entries:
        outs = c.transform.inverse(source[c.mcore], ctx)
        if len(outs) != len(c.hf):
            raise PortingError(
                f"transform {c.transform.name} gave {len(outs)} tensors for {len(c.hf)} HF keys"
            )
        for k, t in zip(c.hf, outs, strict=True):
            part = stacked_part(k)
            if part is None or not stack:
                yield k, t
                continue
            name, index = part
            slices = parts.setdefault(name, {})
            slices[index] = t
            if len(slices) == count[name]:
                if sorted(slices) != list(range(len(slices))):
                    raise PortingError(
                        f"the mapping table makes slices {sorted(slices)} of {name!r}, not "
                        f"0..{len(slices) - 1}"
                    )
                yield name, torch.stack([slices[i] for i in range(len(slices))])
                del parts[name]


class StackedReads:
    """``source`` with the table's slice keys (``name[i]``) readable: each slice read alone where
    the source reads one expert of a stack (``expert(name, i)``, a checkpoint's reader); else the
    stacked tensor is read once, kept while slices of it are still to be read, and dropped after
    its last one (so an import holds about one layer's stacked experts)."""

    def __init__(self, source: TensorSource, entries: Iterable[Concrete]) -> None:
        self.source = source
        self.left: dict[str, int] = {}
        for c in entries:
            for k in c.hf:
                if (part := stacked_part(k)) is not None:
                    self.left[part[0]] = self.left.get(part[0], 0) + 1
        self.held: dict[str, torch.Tensor] = {}

    def keys(self) -> list[str]:
        return self.source.keys()

    def get(self, key: str) -> torch.Tensor:
        part = stacked_part(key)
        if part is None:
            return self.source.get(key)
        name, index = part
        if hasattr(self.source, "expert"):
            return self.source.expert(name, index)
        stacked = self.held.get(name)
        if stacked is None:
            stacked = self.held[name] = self.source.get(name)
        if index >= stacked.shape[0]:
            raise PortingError(
                f"tensor {name!r} stacks {stacked.shape[0]} experts; the table reads slice {index}"
            )
        self.left[name] -= 1
        if not self.left[name]:
            del self.held[name]
        return stacked[index].clone()


class WeightProducer:
    """Each Megatron parameter on demand, read from ``source`` through the table (streamed import).

    The checkpoint writer calls it with a parameter's name when it is about to write that
    parameter; the HF tensors are read, transformed, checked against the model's shape and dtype,
    and handed over, and nothing is kept. :meth:`finish` then checks that every parameter was
    produced exactly once.
    """

    def __init__(
        self,
        source: TensorSource,
        target: Mapping[str, torch.Tensor],
        table: Iterable[Entry],
        ctx: Any,
        num_layers: int,
        progress: Callable[[int], Any] | None = None,
    ) -> None:
        entries, ignores = expand(table, ctx, num_layers)
        entries = resolve_target_names(entries, target.keys())
        entries, self.ignored = plan_import(entries, ignores, source.keys())
        unknown = [c.mcore for c in entries if c.mcore not in target]
        if unknown:
            raise PortingError(
                "mapping table writes parameter(s) the Megatron model does not have: "
                + ", ".join(repr(k) for k in unknown[:10])
            )
        self.source, self.ctx = StackedReads(source, entries), ctx
        self.shapes = {k: (tuple(v.shape), v.dtype) for k, v in target.items()}
        self.entries = {c.mcore: c for c in entries}
        self.produced: set[str] = set()
        self.bar = progress(len(entries)) if progress else None

    def __call__(self, name: str) -> torch.Tensor:
        c = self.entries.get(name)
        if c is None:
            raise PortingError(f"Megatron parameter {name!r} is not written by the mapping table")
        if name in self.produced:
            raise PortingError(f"Megatron parameter {name!r} would be written twice")
        value = produce(c, self.source, self.ctx, *self.shapes[name])
        self.produced.add(name)
        if self.bar is not None:
            self.bar.update()
        return value

    def finish(self) -> ImportReport:
        """Check every parameter was produced; the report of what was consumed and written."""
        if self.bar is not None:
            self.bar.close()
        missing = sorted(set(self.shapes) - self.produced)
        if missing:
            raise PortingError(
                f"{len(missing)} Megatron parameter(s) were not written by the mapping table: "
                + ", ".join(repr(k) for k in missing[:10])
            )
        return ImportReport(
            consumed=sum(len(c.hf) for c in self.entries.values()),
            ignored=self.ignored,
            written=len(self.produced),
        )
