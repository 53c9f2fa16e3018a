"""``prep-data``'s executors: where the tokenizing runs. One module each, one line in
``EXECUTORS``; :mod:`data_prep.executors.base` has their interface (:mod:`porting.launch`'s, which
conversion and training share) and what they share. Importing them is cheap (the command line
lists their flags): each imports its machinery when it runs."""

from __future__ import annotations

from data_prep.executors.base import Executor, Flag
from data_prep.executors.local import Local
from data_prep.executors.ray import Ray
from data_prep.executors.slurm import Slurm
from porting.launch import Executors

#: Every executor by its ``--executor`` name, in the order ``--help`` lists them.
EXECUTORS: Executors[Executor] = Executors(Local(), Ray(), Slurm())


def executor_for(name: str) -> Executor:
    """The executor ``--executor name`` picks."""
    return EXECUTORS.get(name)


def executor_flags() -> list[Flag]:
    """The executors' own flags, each once (several executors share ``--unit-mb``)."""
    return EXECUTORS.flags()
