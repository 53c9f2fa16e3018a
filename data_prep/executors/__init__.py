"""``prep-data``'s executors: where the tokenizing runs. One module each, one line in
``EXECUTORS``; :mod:`data_prep.executors.base` has the interface and what they share. Importing
them is cheap (the command line lists their flags): each imports its machinery when it runs."""

from __future__ import annotations

from data_prep.executors.base import Executor, Flag
from data_prep.executors.local import Local
from data_prep.executors.ray import Ray
from data_prep.executors.slurm import Slurm
from porting.errors import PortingError

#: Every executor by its ``--executor`` name, in the order ``--help`` lists them.
EXECUTORS: dict[str, Executor] = {e.name: e for e in (Local(), Ray(), Slurm())}


def executor_for(name: str) -> Executor:
    """The executor ``--executor name`` picks."""
    if name not in EXECUTORS:
        raise PortingError(f"--executor {name}: one of {', '.join(EXECUTORS)}")
    return EXECUTORS[name]


def executor_flags() -> list[Flag]:
    """The executors' own flags, each once (several executors share ``--unit-mb``)."""
    flags: list[Flag] = []
    for executor in EXECUTORS.values():
        flags += [f for f in executor.flags if f not in flags]
    return flags
