"""Where a command's processes run: the one executor interface of conversion, training and
data prep (``--executor``).

An executor is an object: its ``--executor`` name, its part of that flag's help, the flags of its
own, and what it is (it starts ranks of the same command, or its ranks span nodes through a
scheduler). What a command does with one is the command's: conversion's executors hand a
conversion's ranks a staging directory (:mod:`porting.convert.executors`), training's start a
run's ranks under its lock (:mod:`porting.train.launch`), data prep's tokenize units
(:mod:`data_prep.executors`). What they share lives here, and the scheduler's clients, its script
writer and its follower in :mod:`porting.slurm`, so no command asks which executor it holds by
name: a fourth executor is one class and one line in its command's table.

This module is imported by every command's parser: it imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from porting.errors import PortingError


@dataclass(frozen=True)
class Flag:
    """A command-line flag that only some executors take, and the field it fills (through
    ``convert`` where the flag's unit is not the field's)."""

    option: str
    field: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    convert: Callable[[Any], Any] | None = None
    # argparse's action for a switch (``store_true``); then type and metavar are not given
    action: str | None = None

    def add_to(self, parser) -> None:
        """Declare the flag on an argparse parser or group."""
        if self.action:
            parser.add_argument(self.option, action=self.action, help=self.help)
            return
        parser.add_argument(
            self.option, type=self.type, default=self.default, metavar=self.metavar, help=self.help
        )

    def value(self, args) -> Any:
        """The field's value from parsed arguments."""
        given = getattr(args, self.option.removeprefix("--").replace("-", "_"))
        return given if self.convert is None else self.convert(given)


class Executor:
    """Where a command's work runs. ``name`` is its ``--executor`` value, ``help`` its part of
    that flag's help, ``flags`` the flags of its own."""

    name: ClassVar[str]
    help: ClassVar[str]
    flags: ClassVar[tuple[Flag, ...]] = ()
    #: It starts ranks of the same command beside this process and waits for them.
    starts_ranks: ClassVar[bool] = False
    #: Its ranks run on the nodes a scheduler gives (so they may be many, and what they write
    #: must be on a file system every node sees); otherwise all on this node.
    spans_nodes: ClassVar[bool] = False

    def nodes(self, asked: int) -> int:
        """The nodes a launch of ``asked`` nodes runs on: ``asked`` where it spans nodes."""
        return asked if self.spans_nodes else 1

    def check_size(self, nodes: int, per_node: int, *, nodes_flag: str, ranks_flag: str) -> None:
        """Refuse a launch of ``nodes`` x ``per_node`` ranks that no node can schedule
        (:func:`porting.slurm.check_launch_size`): where its ranks all run on this node, no more
        of them than its cores."""
        from porting import slurm

        slurm.check_launch_size(
            nodes, per_node, local=self.starts_ranks and not self.spans_nodes,
            nodes_flag=nodes_flag, ranks_flag=ranks_flag,
        )  # fmt: skip

    def check_script_values(self, values: Iterable[tuple[str, Any]]) -> None:
        """Refuse, before anything starts, a value a script of this executor would hold that
        its reader could not read back (``(flag, value)``; None: not given). Only a scheduler's
        executor writes one."""

    def check_submit(self, no_submit_flag: str = "--no-submit") -> None:
        """Refuse at once where this executor's scheduler cannot be reached from here."""


class Scheduled(Executor):
    """An executor that writes a batch script and hands it to Slurm (:mod:`porting.slurm`):
    every value the script holds goes through :mod:`porting.shell`, and ``sbatch`` must be here
    before anything is staged."""

    starts_ranks = True
    spans_nodes = True

    def check_script_values(self, values: Iterable[tuple[str, Any]]) -> None:
        from porting import shell

        for flag, value in values:
            if value is not None:
                shell.checked(str(value), flag)

    def check_submit(self, no_submit_flag: str = "--no-submit") -> None:
        from porting import slurm

        slurm.sbatch_path(no_submit_flag)


E = TypeVar("E", bound=Executor)


class Executors(Generic[E]):
    """A command's executors by name, in the order its ``--help`` lists them."""

    def __init__(self, *executors: E) -> None:
        self.by_name: dict[str, E] = {e.name: e for e in executors}

    def __iter__(self):
        return iter(self.by_name)

    def __getitem__(self, name: str) -> E:
        return self.by_name[name]

    def values(self):
        return self.by_name.values()

    def get(self, name: str) -> E:
        """The executor ``--executor name`` picks."""
        if name not in self.by_name:
            raise PortingError(f"--executor {name}: one of {', '.join(self.by_name)}")
        return self.by_name[name]

    def help(self, default: str | None = None) -> str:
        """The ``--executor`` flag's help: each executor's name and its part."""
        said = "; ".join(f"{e.name}: {e.help}" for e in self.by_name.values())
        return said + (f". Default: {default}" if default else "")

    def flags(self) -> list[Flag]:
        """The executors' own flags, each once (several executors may share one)."""
        flags: list[Flag] = []
        for executor in self.by_name.values():
            flags += [f for f in executor.flags if f not in flags]
        return flags

    def add_to(self, parser, default: str = "local", help_default: bool = False) -> None:
        """Declare ``--executor`` on an argparse parser or group."""
        parser.add_argument(
            "--executor",
            choices=list(self.by_name),
            default=default,
            help=self.help(default if help_default else None),
        )
