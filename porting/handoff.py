"""What a launcher of ours hands the processes it starts, and how such a process knows it is one.

A launcher (a conversion's torchrun or Slurm ranks, ``porting train``'s torchrun or NeMo-Run
ranks) passes its ranks their state in one environment variable. A variable alone proves nothing:
a shell carries it on (our own batch scripts export one), and a one-process command that believed
it would write its output into someone else's directory, outside every lock. So the variable
holds a random token that the launcher also writes into a directory it alone creates for this
launch and removes after it (the staging directory, the launcher's private ``TMPDIR``); a process
is a rank of ours only when both agree. A variable without its launch is refused by name.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from porting.errors import PortingError

TOKEN_FILE = ".porting-launch-token"


def hand_off(name: str, directory: str | os.PathLike, **state: object) -> dict[str, str]:
    """The environment that makes the processes a launch starts its ranks: ``{name: value}``,
    the value carrying ``directory`` (created by this launch, removed after it), a fresh token
    written there, and ``state``."""
    token = secrets.token_hex(16)
    where = Path(directory).absolute()
    path = where / TOKEN_FILE
    tmp = path.with_name(TOKEN_FILE + ".tmp")
    tmp.write_text(token)
    tmp.replace(path)
    return {name: json.dumps({"dir": str(where), "token": token, **state})}


def received(name: str) -> dict | None:
    """What a launcher of ours handed this process in ``name`` (its ``dir`` and state), None
    when the variable is unset; an error naming it when it is set without that launch behind it
    (a stray copy in a shell, a launch that is over)."""
    value = os.environ.get(name)
    if not value:
        return None
    return _check(name, value)


def _check(name: str, value: str) -> dict:
    try:
        state = json.loads(value)
        where, token = Path(state["dir"]), state["token"]
    except (ValueError, KeyError, TypeError):
        raise _stray(name, None) from None
    if not isinstance(token, str) or not where.is_absolute():
        raise _stray(name, None)
    try:
        written = (where / TOKEN_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        raise _stray(name, where) from None
    if not secrets.compare_digest(written, token):
        raise _stray(name, where)
    return state


def _stray(name: str, where: Path | None) -> PortingError:
    unseen = (
        f", or this node does not see the launch's directory {where} (ranks on several nodes "
        "need a file system they all see)"
        if where is not None
        else ""
    )
    return PortingError(
        f"{name} is set in this environment, but no launch of porting's is in progress behind "
        f"it: the variable is internal to porting's launchers (a shell or a script carried it "
        f"here){unseen}. Unset it (unset {name}) and run the command again"
    )
