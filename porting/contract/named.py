"""Objects of a family's Megatron side, named instead of imported.

A family's tables must load for ``porting families`` and for every refusal without importing
torch, NeMo or Megatron (seconds and most of a gigabyte). So the contract names the Megatron side
as ``"module:qualname"`` (``"models.falcon_nemo:FalconConfig"``) and the engine loads it when a
conversion needs it; a config entry that must hand the Megatron config a function (an activation,
a layer spec) returns a :class:`Named` and the engine resolves it as the config is built.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from porting.errors import PortingError

_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def is_ref(value: Any) -> bool:
    """Whether ``value`` is a ``"module:qualname"`` reference."""
    return isinstance(value, str) and _REF.fullmatch(value) is not None


def load(ref: str | Any) -> Any:
    """The object ``ref`` names (``"module:qualname"``); anything else is returned as it is."""
    if not isinstance(ref, str):
        return ref
    if not is_ref(ref):
        raise PortingError(f"{ref!r} is not a 'module:qualname' reference")
    module, qualname = ref.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PortingError(f"{ref}: module {module} has no {qualname!r}") from None
    return obj


def module_of(ref: str | Any) -> str:
    """The module that defines ``ref``, without importing it when it is a reference."""
    return ref.split(":")[0] if isinstance(ref, str) else ref.__module__


@dataclass(frozen=True)
class Named:
    """A value for the Megatron config that is an object of the family's Megatron side (an
    activation function, a layer-spec function), named so that the contract never imports it."""

    ref: str

    def __post_init__(self) -> None:
        if not is_ref(self.ref):
            raise PortingError(f"Named({self.ref!r}): not a 'module:qualname' reference")

    def load(self) -> Any:
        return load(self.ref)


def resolve(values: dict) -> dict:
    """``values`` with every :class:`Named` loaded (the engine, building a Megatron config)."""
    return {k: v.load() if isinstance(v, Named) else v for k, v in values.items()}
