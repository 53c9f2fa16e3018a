"""The one writer of everything we hand to a shell or a scheduler: batch scripts, launch scripts,
``nccl.env``, flag files.

It takes values, never pre-formatted text, and quotes each for the place it lands:

- a command word (:func:`word`, :func:`command`): POSIX single quotes (``shlex.quote``);
- an ``#SBATCH`` directive (:func:`directive`): double quotes with ``\\`` and ``"`` escaped, the
  quoting sbatch's own directive reader understands (``_get_argument`` in Slurm's
  ``src/sbatch/opt.c``: quotes group, a backslash escapes the next character, an unquoted ``#``
  ends the line). ``shlex.quote`` is wrong there: sbatch drops the backslash of ``'a\\b'``;
- an ``export NAME=VALUE`` line (:func:`export`): a command word after a checked name.

Quoting protects a word, not a line: a newline ends a directive or a comment whatever quotes
surround it, and the rest of the value runs as a command. So every value that reaches a script
(or a file name a script names) is first refused if it holds a control character (C0, DEL, C1),
naming the flag it came from (:func:`checked`). A shell variable the script is to expand is a
value of its own kind (:class:`Ref`: an identifier, nothing around it), never a string that
happens to begin with ``"$``.

A set of files that belong together (a plan's launch files, prep-data's job and scripts) is
written by :func:`write_set`: staged, then renamed in as a set, nothing new left on a failure.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from porting.errors import PortingError

# C0 controls (newline, CR, NUL, ESC...), DEL and the C1 set: none has a place in a flag's value,
# and each either ends a line (LF, CR; VT and FF for some readers) or hides what a script says.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REFERENCE = re.compile(r'"?\$([A-Za-z_][A-Za-z0-9_]*)"?')
_HETJOB = re.compile(r"hetjob|packjob", re.IGNORECASE)


@dataclass(frozen=True)
class Ref:
    """A shell variable the script expands where it runs: written as ``"$NAME"``."""

    name: str

    def __post_init__(self) -> None:
        if not _IDENTIFIER.fullmatch(self.name):
            raise PortingError(f"{self.name!r} is not a shell variable name")

    def __str__(self) -> str:
        return f'"${self.name}"'


def checked(value: str, what: str) -> str:
    """``value`` if it holds no control character; else an error naming ``what`` (a flag) and
    the character."""
    found = _CONTROL.search(value)
    if found is not None:
        raise PortingError(
            f"{what}: {value!r} holds the control character {found.group()!r} (position "
            f"{found.start()}); a value that reaches a script or a file name may not (it would "
            "end the line it is written on)"
        )
    return value


def reference_or_value(value: str, what: str) -> str | Ref:
    """A flag's value as the user meant it: ``$NAME`` or ``"$NAME"`` is a :class:`Ref`; anything
    else beginning with ``$`` or ``"$`` is refused (half a reference, or a reference with more
    after it: ``"$DATA"$(touch X)``); any other value is a literal, checked."""
    checked(value, what)
    if not value.startswith(("$", '"$')):
        return value
    found = _REFERENCE.fullmatch(value)
    if found is None or value.startswith('"') != value.endswith('"'):
        raise PortingError(
            f'{what}: {value!r} begins like a shell variable but is not one; give "$NAME" (NAME '
            "a shell variable name, nothing after it) or a path"
        )
    return Ref(found.group(1))


def word(value: str | Ref | int, what: str) -> str:
    """One command word: a :class:`Ref` as ``"$NAME"``, anything else quoted."""
    if isinstance(value, Ref):
        return str(value)
    return shlex.quote(checked(str(value), what))


def argv_names(argv: list[str | Ref], first: str = "argument") -> list[str]:
    """What to call each element of ``argv`` in an error: the flag a value follows (``--out``),
    the flag itself, or ``argument N`` for a positional one."""
    names = []
    for i, a in enumerate(argv):
        text = str(a)
        if text.startswith("--"):
            names.append(text.split("=", 1)[0])
        elif i and str(argv[i - 1]).startswith("-") and "=" not in str(argv[i - 1]):
            names.append(str(argv[i - 1]))
        else:
            names.append(f"{first} {i + 1}")
    return names


def command(argv: list[str | Ref], what: str = "argument") -> str:
    """``argv`` as one line of words, each checked and quoted, named by its flag in an error."""
    return " ".join(word(a, n) for a, n in zip(argv, argv_names(argv, what), strict=True))


def directive(option: str, value: str | int, what: str | None = None) -> str:
    """``#SBATCH --option=value`` as sbatch reads it back to exactly ``value`` (in double quotes
    unless it is one plain word). sbatch splits a heterogeneous job at any directive line that
    contains ``hetjob`` or ``packjob``, quoted or not, in any case: such a value is refused."""
    if not re.fullmatch(r"[a-z][a-z-]*", option):
        raise ValueError(f"not an sbatch option: {option!r}")
    what = what or f"--{option}"
    text = checked(str(value), what)
    found = _HETJOB.search(text)
    if found is not None:
        raise PortingError(
            f"{what}: {text!r} holds {found.group()!r}, which sbatch reads in a #SBATCH line as "
            "the start of another component of a heterogeneous job; choose another name"
        )
    if re.fullmatch(r"[A-Za-z0-9._:/%+@,=-]+", text):
        return f"#SBATCH --{option}={text}"
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'#SBATCH --{option}="{escaped}"'


def log_pattern(directory: str | os.PathLike, name: str, what: str) -> str:
    """An ``--output`` file name in ``directory``: sbatch expands ``%`` in it (``%j`` the job id),
    so the directory's own ``%`` are doubled; ``name`` keeps its patterns. A backslash anywhere
    turns every pattern off (Slurm's ``src/common/fname.c``), so a directory holding one is
    refused, named ``what``."""
    text = checked(str(Path(directory).absolute()), what)
    if "\\" in text:
        raise PortingError(
            f"{what}: {text!r} holds a backslash, which makes Slurm take a log file name "
            "literally (no %j): choose a directory without one"
        )
    return text.replace("%", "%%") + "/" + name


def export(name: str, value: str | Ref, what: str) -> str:
    """``export NAME=VALUE``."""
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"not an environment variable name: {name!r}")
    return f"export {name}={word(value, what)}"


def comment(text: str) -> str:
    """A ``#`` line whose text cannot end it early."""
    return "# " + checked(text, "a comment")


def write_set(
    directory: str | os.PathLike, files: dict[str, tuple[str, int]], what: str
) -> list[Path]:
    """Write ``files`` (name: (text, mode)) into ``directory`` as one set.

    A new directory is staged beside it and renamed into place once (with the mode ``mkdir``
    would give it). Into an existing one (a previous emit, with the user's own files beside it: a
    hostfile, measured logs), the set is staged inside it, the old files of the same names moved
    aside, the new ones renamed in, and the old ones removed; a failure puts the old ones back.
    Either way a failure (a full disk) leaves no new file or directory and says which file and
    where.
    """
    out = Path(directory).absolute()
    if out.exists() and not out.is_dir():
        raise PortingError(f"{what} {out}: not a directory (nothing was written)")
    made: list[Path] = []  # parents this call creates, removed again on a failure
    stage = current = None
    try:
        parent = out if out.is_dir() else out.parent
        for missing in reversed([parent, *parent.parents]):
            if not missing.exists():
                missing.mkdir()
                made.append(missing)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.emit-", dir=parent))
        for name, (text, mode) in files.items():
            current = stage / name
            current.write_text(text)
            os.chmod(current, mode)
        current = None
        if out.is_dir():
            _swap_in(out, stage, list(files))
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(stage, 0o777 & ~umask)
            os.replace(stage, out)
            stage = None
    except OSError as err:
        for parent_made in reversed(made):
            shutil.rmtree(parent_made, ignore_errors=True)
        where = f" writing {current.name}" if current is not None else ""
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        reason = "no space left on the device" if full else (err.strerror or str(err))
        raise PortingError(f"{what} {out}: {reason}{where}; nothing was written") from err
    finally:
        if stage is not None and not (stage / _KEPT).exists():
            shutil.rmtree(stage, ignore_errors=True)
    return [out / name for name in files]


# Left in a staging directory whose old files could not be put back: it then holds them.
_KEPT = ".kept"


def _swap_in(out: Path, stage: Path, names: list[str]) -> None:
    """Move ``names`` from ``stage`` into ``out``, the old ones aside first and back on failure
    (if putting them back fails too, they stay in ``stage/.kept`` and the error says so)."""
    aside = stage / ".aside"  # no name of a set begins with a dot
    aside.mkdir()
    moved_aside, moved_in = [], []
    try:
        for name in names:
            if (out / name).exists() or (out / name).is_symlink():
                os.replace(out / name, aside / name)
                moved_aside.append(name)
        for name in names:
            os.replace(stage / name, out / name)
            moved_in.append(name)
    except OSError as err:
        try:
            for name in moved_in:
                (out / name).unlink(missing_ok=True)
            for name in moved_aside:
                os.replace(aside / name, out / name)
        except OSError:
            os.replace(aside, stage / _KEPT)
            raise OSError(
                err.errno, f"{err.strerror}; the earlier files are kept in {stage / _KEPT}"
            ) from err
        raise
