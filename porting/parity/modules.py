"""Module tensors set, listed and released by name: how the streamed gate loads a layer just
before it runs and frees it after (:mod:`porting.parity.streamed`, :mod:`porting.parity.mtp`)."""

from __future__ import annotations

import torch


def set_param(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    if leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def stored_tensors(module: torch.nn.Module):
    """``(name, tensor)`` of what a checkpoint holds of ``module``: its parameters and its
    persistent buffers (a router's expert bias)."""
    saved = set(module.state_dict(keep_vars=True))
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if n in saved)


def release(module: torch.nn.Module) -> None:
    """Put ``module``'s parameters back on the meta device (frees their memory)."""
    for name, p in list(module.named_parameters()):
        set_param(module, name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
