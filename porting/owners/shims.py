"""The one place where the owners' packages are taught to run here: no GPU, no Transformer Engine.

Megatron-Core's own CPU needs are :mod:`porting.cpu`'s (it serves Megatron-Core 0.15 and 0.19
alike); this module adds only what Megatron-LM's and Megatron-Bridge's training code needs beyond
it. :func:`install` is a no-op for each part whose package is really there.

- Transformer Engine: ``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch``
  at module level, unguarded, and ``megatron/bridge/__init__.py`` imports it (through every model
  bridge) on ``import megatron.bridge``. Transformer Engine does not install without CUDA. Only
  while that one module executes, ``transformer_engine`` and ``transformer_engine.pytorch`` are
  stand-ins whose every name is a class nothing is an instance of and that cannot be built; they
  are removed from ``sys.modules`` right after, so Megatron-Core's own ``import
  transformer_engine`` checks still find no Transformer Engine (tested).
- ``nvidia_resiliency_ext.inprocess.CallWrapper``: ``megatron/bridge/training/pretrain.py``
  imports it for a type annotation only; the real package's import breaks Megatron-Core 0.19's
  version check (``dist_checkpointing/strategies/nvrx.py``), and in-process restart stays off.
- Megatron-Bridge's ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda`` is passed
  (``megatron/bridge/training/initialize.py``), which ``setup.py`` never does; it runs ``make``
  for dataset helpers that the wheel ships prebuilt and without a Makefile; and it warms up
  CUDA fusion kernels.
- ``torch.cuda.get_rng_state``: Megatron-LM's ``save_checkpoint`` (``get_rng_state``) saves the CUDA
  generator's state beside the CPU one on every save.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import torch

# The modules that import Transformer Engine unguarded, and what they import first (imported
# before the stand-in appears, so that they see the truth).
NEEDS_TE = {
    "megatron.bridge.peft.lora_layers": (
        "megatron.core.transformer.moe.moe_utils",
        "megatron.bridge.peft.adapter_wrapper",
        "megatron.bridge.peft.lora_merge",
    )
}


class _Absent(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{cls.__qualname__}.{name}")


class _Unavailable(metaclass=_Absent):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__qualname__}: Transformer Engine is not installed")


_CLASSES: dict[str, type] = {}


def _absent(qualname: str) -> type:
    if qualname not in _CLASSES:
        _CLASSES[qualname] = _Absent(
            qualname.rsplit(".", 1)[-1], (_Unavailable,), {"__qualname__": qualname}
        )
    return _CLASSES[qualname]


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{self.__name__}.{name}")


class _WithStandIn(importlib.abc.Loader):
    def __init__(self, inner, first: tuple[str, ...]) -> None:
        self.inner, self.first = inner, first

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        for name in self.first:
            importlib.import_module(name)
        te = _AbsentModule("transformer_engine")
        te_torch = _AbsentModule("transformer_engine.pytorch")
        te.__path__, te_torch.__path__, te.pytorch = [], [], te_torch
        sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"] = te, te_torch
        try:
            self.inner.exec_module(module)
        finally:
            del sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in NEEDS_TE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = _WithStandIn(spec.loader, NEEDS_TE[fullname])
        return spec


_INSTALLED = False


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        return False


def install() -> None:
    """Install every part above that this environment needs (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    if importlib.util.find_spec("transformer_engine") is None:
        sys.meta_path.insert(0, _Finder())
    if not _importable("nvidia_resiliency_ext.inprocess"):
        root = types.ModuleType("nvidia_resiliency_ext")
        inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess")
        inprocess.CallWrapper = type("CallWrapper", (), {})
        root.__path__, root.inprocess = [], inprocess
        sys.modules["nvidia_resiliency_ext"] = root
        sys.modules["nvidia_resiliency_ext.inprocess"] = inprocess
    if not torch.cuda.is_available():
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()


def one_cpu_process() -> None:
    """Ready this process to be the whole of a run: its own rendezvous, whatever the caller's
    environment says (a test's own gloo store may hold MASTER_PORT), Megatron-Core's CPU layer
    (:mod:`porting.cpu`, which serves Megatron-Core 0.19 unchanged) and :func:`install`."""
    import os

    from porting import cpu

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(cpu.free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    cpu.enable()
    cpu.enable_training()
    install()


def bridge_training() -> None:
    """Let Megatron-Bridge's ``pretrain`` start without CUDA (see the module docstring)."""
    install()
    if torch.cuda.is_available():
        return
    import functools

    from megatron.bridge.training import initialize, setup

    setup.initialize_megatron = functools.partial(
        initialize.initialize_megatron, allow_no_cuda=True
    )
    initialize.compile_helpers = lambda: None
    # It warms up the fused CUDA kernels (bias+SwiGLU, bias+dropout+add) on device "cuda"; with
    # nothing to warm on the CPU it would only fail on an odd ffn_hidden_size (it feeds SwiGLU's
    # halving an ffn_hidden_size-wide input, not twice that).
    initialize._warmup_jit_function = lambda *a, **k: None
