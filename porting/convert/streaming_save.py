"""Writing a Megatron ``torch_dist`` checkpoint one tensor at a time, from a producer.

Why the stock save holds the model: ``TorchDistSaveShardedStrategy.async_save`` ->
``FileSystemWriterAsync.prepare_write_data`` resolves every write item up front and keeps them all
(``megatron/core/dist_checkpointing/strategies/filesystem_async.py``), cloning views such as the two
SwiGLU halves of ``linear_fc1``; so an import had to hold every produced tensor in the model first.

Here the model's parameters are never filled: NeMo's own save path runs unchanged (the same
sharded state dict, factories, validation, ``common.pt``, ``metadata.json`` and ``.metadata``),
except for two parts of the sharded-save strategy:

- :class:`LazySavePlanner` (an ``MCoreSavePlanner``): a write item resolves to a view of a model
  parameter; the parameter is found by its storage, its real value is asked of the producer, and
  the same view (size, stride, offset) is taken of that;
- :class:`StreamingWriter` (a ``FileSystemWriterAsync``): items are resolved and written one at a
  time, in model order, into the files Megatron's ``_split_by_size_and_type`` assigns them to, and
  released once written.

Peak memory is the largest tensor the producer makes plus its sources. Everything here leans on
private internals of torch and Megatron-Core, pinned to torch 2.13 / megatron-core 0.15.3: torch's
``filesystem._write_item`` (its signature changed across versions), ``UntypedStorage._cdata``,
Megatron's ``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``,
``_split_by_size_and_type`` and ``save_state_dict_async_plan`` / ``save_state_dict_async_finalize``
(``megatron/core/dist_checkpointing/strategies/{torch,filesystem_async,state_dict_saver}.py``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

import torch
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    FileSystemWriterAsync,
    _split_by_size_and_type,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from megatron.core.msc_utils import MultiStorageClientFeature
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from porting.errors import PortingError

Producer = Callable[[str], torch.Tensor]


def params_by_storage(module: torch.nn.Module) -> dict[int, tuple[str, int, torch.Tensor]]:
    """Storage id -> (state-dict name, order, tensor) for every parameter of ``module``."""
    out = {}
    for i, (name, t) in enumerate(module.state_dict(keep_vars=True).items()):
        if isinstance(t, torch.Tensor) and not name.endswith("_extra_state"):
            if not t.is_contiguous() or t.storage_offset() != 0:
                raise PortingError(f"{name}: the parameter is a view; cannot stream it")
            out.setdefault(t.untyped_storage()._cdata, (name, i, t))
    return out


class LazySavePlanner(MCoreSavePlanner):
    """``MCoreSavePlanner`` whose ``resolve_data`` asks the producer for parameter data."""

    def __init__(self, producer: Producer, params: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.producer = producer
        self.params = params
        self._name: str | None = None
        self._value: torch.Tensor | None = None

    def source(self, write_item):
        """``(name, order, tensor)`` of the parameter a tensor item views, else ``None``."""
        obj = self.lookup_object(write_item.index)
        if not isinstance(obj, torch.Tensor):
            return None
        return self.params.get(obj.untyped_storage()._cdata)

    def _produce(self, name: str, param: torch.Tensor) -> torch.Tensor:
        if self._name != name:
            self._value = None  # drop the previous tensor before making the next
            t = self.producer(name)
            if tuple(t.shape) != tuple(param.shape) or t.dtype != param.dtype:
                raise PortingError(
                    f"{name}: produced {tuple(t.shape)} {t.dtype}, the model has "
                    f"{tuple(param.shape)} {param.dtype}"
                )
            t = t.detach().contiguous()
            if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes:
                t = t.clone()
            self._name, self._value = name, t
        return self._value

    def release(self) -> None:
        """Forget the last produced tensor."""
        self._name, self._value = None, None

    def resolve_data(self, write_item):
        """The item's data: a view of the produced parameter, or what the stock planner gives."""
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        obj = self.lookup_object(write_item.index)
        src = self.source(write_item)
        if src is None:
            return super().resolve_data(write_item)
        name, _, param = src
        full = self._produce(name, param)
        return full.as_strided(obj.size(), obj.stride(), obj.storage_offset())


class StreamingWriter(FileSystemWriterAsync):
    """``FileSystemWriterAsync`` that writes item by item, in this process, retaining nothing."""

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Remember the plan; the stock writer resolves every item here, which is the problem."""
        self._plan, self._planner = plan, planner
        self.write_buckets = []
        self._results = None

    def write_streaming(self) -> None:
        """Write every item of the plan into Megatron's file assignment, one at a time."""
        plan, planner = self._plan, self._planner
        prefix = plan.storage_data.prefix
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        names = [f"{prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]
        file_of = {item.index: fi for fi, bucket in enumerate(buckets) for item in bucket}
        extra = {}
        if "serialization_format" in inspect.signature(_write_item).parameters:
            from torch.distributed.checkpoint.filesystem import SerializationFormat

            extra["serialization_format"] = SerializationFormat.TORCH_SAVE
        transforms = [self.transforms] if hasattr(self, "transforms") else []
        byte_items = [it for it in plan.items if it.type == WriteItemType.BYTE_IO]
        tensor_items = [it for it in plan.items if it.type != WriteItemType.BYTE_IO]

        def order(item):
            src = planner.source(item)
            return (
                (-1, 0)
                if src is None
                else (src[1], planner.lookup_object(item.index).storage_offset())
            )

        tensor_items.sort(key=order)  # by source parameter: each is produced once
        if self.use_msc:  # as FileSystemWriterAsync.write_preloaded_data does
            import multistorageclient as msc

            open_file = msc.open
        else:
            open_file = open
        results = []
        streams = [open_file(os.path.join(self.checkpoint_dir, n), "wb") for n in names]
        try:
            for item in byte_items + tensor_items:
                fi = file_of[item.index]
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    data = data.detach()
                    if data.untyped_storage().nbytes() != data.nbytes:
                        data = data.clone()  # torch.save writes the whole storage of a view
                results.append(
                    _write_item(*transforms, streams[fi], data, item, names[fi], **extra)
                )
                del data
            planner.release()
            for s in streams:
                s.flush()
                s.fsync() if self.use_msc else os.fsync(s.fileno())
        finally:
            for s in streams:
                s.close()
        self._results = results

    def retrieve_write_results(self):
        """The write results of :meth:`write_streaming`, as torch's finalize step expects."""
        if self._results is None:
            raise RuntimeError("write_streaming() was not run")
        return self._results


class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """The ``torch_dist`` v1 save strategy (same backend and version as the stock one), streamed.

    Synchronous only: it is installed with NeMo's asynchronous and fully-parallel saving off.
    """

    def __init__(self, producer: Producer, params: dict, thread_count: int = 2) -> None:
        super().__init__("torch_dist", 1, thread_count=thread_count)
        self.producer, self.params = producer, params

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        """Same translation as ``TorchDistSaveShardedStrategy.async_save``, then a streamed write."""
        sd, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sd, False)
        writer = StreamingWriter(
            str(checkpoint_dir),
            thread_count=self.thread_count,
            use_msc=MultiStorageClientFeature.is_enabled(),  # as the stock strategy
        )
        planner = LazySavePlanner(
            self.producer,
            self.params,
            dedup_replicated_tensors=not self.keep_only_main_replica,
            flatten_state_dict=False,
        )
        ret = save_state_dict_async_plan(pyt_state_dict, writer, None, 0, planner=planner)
        writer.write_streaming()
        save_state_dict_async_finalize(*ret[0])  # gathers results, writes .metadata


def install(trainer, module: torch.nn.Module, producer: Producer, parallel: bool = False) -> None:
    """Make ``trainer``'s next checkpoint save stream ``module``'s parameters from ``producer``.

    The trainer's strategy must have been built with ``ckpt_async_save=False`` and
    ``ckpt_parallel_save=False`` (NeMo then calls the sharded strategy's ``save`` directly).
    ``parallel``: the ranks of the data-parallel group share the writing (:func:`fully_parallel`).
    """
    io = trainer.strategy.checkpoint_io
    if getattr(io, "async_save", False) or not hasattr(io, "_save_sharded_strategy"):
        raise PortingError("streaming save needs NeMo's synchronous MegatronCheckpointIO")
    strategy = StreamingSaveStrategy(producer, params_by_storage(module))
    io._save_sharded_strategy = fully_parallel(strategy) if parallel else strategy


def fully_parallel(strategy: StreamingSaveStrategy):
    """``strategy`` shared by the ranks of the data-parallel group, as Megatron's fully-parallel
    save shares it (``FullyParallelSaveStrategyWrapper``: each tensor's main replica goes to one
    rank, balanced by size); a rank's producer is asked only for its share."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelSaveStrategyWrapper(strategy, group)
