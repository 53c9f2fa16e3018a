"""Reading the files a checkpoint brings (each one inside the checkpoint) and those a user names
(:func:`read_named_text`: a cluster file, a config, a log): each text one bounded, every JSON and
YAML parsed here, whoever reads it (conversion, training, the planner).

A checkpoint comes from elsewhere (a download, another team's run), so nothing in it may decide
what we open or how much a parse costs. Every file a checkpoint names, in any layout, goes through
:func:`regular_file` / :func:`open_file`: a regular file, not itself a symbolic link, whose real
path lies inside the checkpoint's root (a link on the way that leaves it is refused too). A FIFO,
device or socket is refused before it is opened, and the open itself uses ``O_NOFOLLOW`` and
``O_NONBLOCK``, so a file swapped after the check can neither redirect the read nor block it.

A hard link is accepted: it is the file itself, indistinguishable from one written in place, and
checkpoints copied with ``cp -al`` or ``rsync --link-dest`` are made of them. Making one needs
write access to the target's file system, which a downloaded checkpoint does not have.

Every text file is parsed by :func:`read_json`, :func:`read_yaml` or :func:`read_int`, with limits
that keep a small hostile file from costing much time or memory, whatever parses it next:

- size, from ``fstat`` before any byte is read, then strict UTF-8;
- nesting depth at most :data:`MAX_DEPTH`, counted without recursion (Python's ``json`` and
  PyYAML's composer recurse per level, and so do the walkers that check what they return);
- number literals at most :data:`MAX_NUMBER_CHARS` characters: ``int()`` of 5000 digits raises;
  a literal too large for a float (``1e999999``) is refused, while the spellings of infinity and
  NaN (JSON's ``NaN``/``Infinity``, which Python writes; YAML's ``.inf``/``.nan``, which
  Megatron-Bridge writes) are read as the floats they are, and judged by the rule of the field
  that holds them;
- a key given twice is refused (both parsers keep one of the two silently);
- strings are Unicode (a ``\\ud800`` escape is not: ``os`` calls and printing fail on it);
- YAML: aliases count at their expanded size, so a 1 KB "billion laughs" is refused once its
  expansion passes :data:`MAX_YAML_NODES`; an alias inside its own anchor (a cycle) is refused.
  Anchors and merge keys are otherwise data, as YAML defines them: Megatron-Bridge writes none
  (``yaml.safe_dump`` of freshly built dicts), but a hand-edited file may use them harmlessly.

Each failure is one :class:`PortingError` naming the file and the problem.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from porting.errors import PortingError

# Generous for what checkpoints hold (ours: run_config.yaml 7 KB, porting.json 1 KB, NeMo's io.json
# 30 KB); callers with a known larger file (a tokenizer) pass their own bound.
MAX_TEXT_BYTES = 16 << 20
# Real files nest under 10 levels; 100 keeps every recursive consumer far from Python's limit.
MAX_DEPTH = 100
# A float's repr is at most 24 characters and a 64-bit integer 20.
MAX_NUMBER_CHARS = 100
# What a tree walk of one YAML document may visit once aliases are expanded: our run_config.yaml
# has some 230 nodes, a 1 KB alias bomb expands to 10**9.
MAX_YAML_NODES = 1_000_000

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISREG, "a regular file"),
)


def _kind(mode: int) -> str:
    return next((k for test, k in _KINDS if test(mode)), "a special file")


def _lstat(path: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise PortingError(f"{path}: missing") from None
    except OSError as err:
        raise PortingError(f"{path}: cannot be read ({err.strerror})") from None
    except ValueError as err:  # a NUL byte or a lone surrogate in a name the checkpoint gave
        raise PortingError(f"{path!r}: not a usable file name ({err})") from None


def _inside(path: Path, root: str | os.PathLike) -> None:
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:
        raise PortingError(
            f"{path}: resolves to {real}, outside the checkpoint {root}; refusing to read it"
        )


def regular_file(path: str | os.PathLike, inside: str | os.PathLike) -> Path:
    """``path`` if it is a regular file, not a symbolic link, whose real path lies in ``inside``
    (the checkpoint's root); a FIFO, device or socket is refused without being opened."""
    path = Path(path)
    mode = _lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise PortingError(f"{path}: is a symbolic link; refusing to follow it")
    if not stat.S_ISREG(mode):
        raise PortingError(f"{path}: is {_kind(mode)}, not a regular file; refusing to open it")
    _inside(path, inside)
    return path


def checkpoint_dir(path: str | os.PathLike, inside: str | os.PathLike) -> Path:
    """``path`` if it is a directory, not a symbolic link, whose real path lies in ``inside``."""
    path = Path(path)
    mode = _lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise PortingError(f"{path}: is {_kind(mode)}, not a directory of the checkpoint")
    _inside(path, inside)
    return path


def open_file(path: str | os.PathLike, inside: str | os.PathLike) -> BinaryIO:
    """``path`` opened for binary reading once :func:`regular_file` accepts it."""
    path = regular_file(path, inside)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise PortingError(f"{path}: cannot be opened ({err.strerror})") from None
    f = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # replaced since the check
        f.close()
        raise PortingError(f"{path}: is {_kind(mode)}, not a regular file; refusing to read it")
    os.set_blocking(fd, True)
    return f


def read_bytes(path: str | os.PathLike, inside: str | os.PathLike, max_bytes: int) -> bytes:
    """The contents of ``path`` (:func:`open_file`), refused beyond ``max_bytes``."""
    with open_file(path, inside) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise PortingError(
                f"{path}: {size} bytes, more than the {max_bytes} this file may hold"
            )
        data = f.read(size + 1)  # one more: a file that grows since fstat is not read in part
    if len(data) != size:
        raise PortingError(f"{path}: changed while it was read ({size} bytes, then {len(data)})")
    return data


def read_text(
    path: str | os.PathLike, inside: str | os.PathLike, max_bytes: int = MAX_TEXT_BYTES
) -> str:
    """:func:`read_bytes` decoded as strict UTF-8."""
    return _decoded(read_bytes(path, inside, max_bytes), str(path))


def read_named_text(path: str | os.PathLike, what: str, max_bytes: int) -> str:
    """The strict UTF-8 text of a file the user names (a cluster file, a config, a log), or one a
    caller has vetted by its own rule (an HF directory's, whose hub links are allowed): taken
    where its links lead, it must be a regular file (a FIFO or a device is refused without a
    read; ``O_NONBLOCK`` keeps one swapped in from blocking) of at most ``max_bytes``. ``what``
    names it in errors."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise PortingError(f"{what}: cannot read ({err.strerror or err})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise PortingError(f"{what}: is {_kind(info.st_mode)}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        os.set_blocking(fd, True)
        size = info.st_size
        if size > max_bytes:
            raise PortingError(f"{what}: {size} bytes is more than the limit of {max_bytes}")
        try:
            raw = f.read(max_bytes + 1)
        except OSError as err:
            raise PortingError(f"{what}: cannot read ({err.strerror or err})") from None
    if len(raw) > max_bytes:
        raise PortingError(f"{what}: more than the limit of {max_bytes} bytes")
    return _decoded(raw, what)


def _decoded(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PortingError(
            f"{what}: not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start})"
        ) from None


def _make_shower():
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 6, 6, 4, 4
    r.maxstring, r.maxother, r.maxlong = 60, 60, 40
    return r


_SHOWER = _make_shower()


def shown(value: Any) -> str:
    """``repr`` of a value read from a checkpoint, for an error message, at a bounded cost: a
    pickle of a few KB can hold a list that refers to itself many times over (its repr grows as
    2**n) or nests 10**5 deep (repr recurses); this shows at most a few levels and items."""
    return _SHOWER.repr(value)


class _Refused(ValueError):
    """A bound broken inside a parser's hook; becomes the file's PortingError."""


def _number(text: str, limit: int = MAX_NUMBER_CHARS) -> str:
    if len(text) > limit:
        raise _Refused(f"a number of {len(text)} characters ({text[:20]}...); at most {limit}")
    return text


def _finite(value: float, text: str) -> float:
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is not finite")
    return value


def _json_float(text: str, limit: int = MAX_NUMBER_CHARS) -> float:
    return _finite(float(_number(text, limit)), text)


def _json_constant(text: str) -> float:
    # NaN, Infinity, -Infinity: what Python's json writes for such floats (transformers' config
    # files included); data here, judged by the rule of the field that holds it
    return float(text)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads`` ``object_pairs_hook`` refusing a repeated key (``json`` keeps the last)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def _check_tree(data: Any, path: Path) -> None:
    """Depth and strings of parsed ``data``, without recursion (a YAML alias is walked as the
    tree it stands for, which :func:`_check_yaml_events` has bounded)."""
    todo = [(data, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise PortingError(
                    f"{path}: the string {node[:40]!r} is not Unicode text (a lone surrogate)"
                ) from None
        elif isinstance(node, dict | list):
            if depth >= MAX_DEPTH:
                raise PortingError(f"{path}: nested deeper than {MAX_DEPTH} levels")
            items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            todo.extend((v, depth + 1) for v in items)


def read_json(
    path: str | os.PathLike, inside: str | os.PathLike, max_bytes: int = MAX_TEXT_BYTES
) -> Any:
    """The JSON value in ``path`` (:func:`regular_file` in ``inside``), within the bounds above."""
    path = Path(path)
    return parse_json(read_text(path, inside, max_bytes), path)


def parse_json(text: str, path: str | os.PathLike, number_chars: int = MAX_NUMBER_CHARS) -> Any:
    """The JSON value of ``text`` (read from ``path``, which errors name), within the bounds
    above; for files read by other rules (an HF directory's, whose hub links are allowed, or a
    file the user names). ``number_chars``: a caller whose every number is then checked by the
    rule of its field (the planner) may let numbers up to Python's own ``int()`` limit through,
    so that the field is named."""
    try:
        data = json.loads(
            text,
            object_pairs_hook=unique_keys,
            parse_int=lambda s: int(_number(s, number_chars)),
            parse_float=functools.partial(_json_float, limit=number_chars),
            parse_constant=_json_constant,
        )
    except _Refused as err:
        raise PortingError(f"{path}: {err}") from None
    except RecursionError:
        raise PortingError(f"{path}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # json.JSONDecodeError
        raise PortingError(f"{path}: not valid JSON ({err})") from None
    _check_tree(data, path)
    return data


def read_int(
    path: str | os.PathLike, inside: str | os.PathLike, what: str, words: tuple[str, ...] = ()
) -> int | str:
    """The non-negative decimal integer (ASCII digits, at most 18) or one of ``words`` that
    ``path`` holds, surrounding whitespace aside; ``what`` names it for the error."""
    text = read_text(path, inside, max_bytes=64).strip()
    if text in words:
        return text
    if not re.fullmatch(r"[0-9]{1,18}", text):
        alternatives = "".join(f" or {w!r}" for w in words)
        raise PortingError(f"{path}: holds {text[:40]!r}, not {what}{alternatives}")
    return int(text)


def _yaml_problem(err: Exception) -> str:
    """A YAML error as one line: its problem and where."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _check_yaml_events(events, path: Path) -> None:
    """Depth and expanded size of a YAML stream from its parser events (no recursion, nothing
    composed): an alias counts as the nodes and levels of its anchor's node."""
    import yaml

    anchors: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, collection levels) of its node
    open_anchors: set[str] = set()
    frames: list[list] = []  # open collections: [nodes so far, deepest child, anchor]
    visited = 0

    def add(nodes: int, levels: int) -> None:
        nonlocal visited
        visited += nodes
        if visited > MAX_YAML_NODES:
            raise PortingError(
                f"{path}: expands to more than {MAX_YAML_NODES} nodes (aliases count at the size "
                "of what they repeat)"
            )
        if len(frames) + levels > MAX_DEPTH:
            raise PortingError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if frames:
            frames[-1][0] += nodes
            frames[-1][1] = max(frames[-1][1], levels)

    for event in events:
        if isinstance(event, yaml.CollectionStartEvent):
            add(1, 1)
            frames.append([1, 0, event.anchor])
            if event.anchor:
                open_anchors.add(event.anchor)
        elif isinstance(event, yaml.CollectionEndEvent):
            nodes, deepest, anchor = frames.pop()
            if frames:  # the start already counted this node itself
                frames[-1][0] += nodes - 1
                frames[-1][1] = max(frames[-1][1], deepest + 1)
            if anchor:
                anchors[anchor] = (nodes, deepest + 1)
                open_anchors.discard(anchor)
        elif isinstance(event, yaml.ScalarEvent):
            add(1, 0)
            if event.anchor:
                anchors[event.anchor] = (1, 0)
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor in open_anchors:
                raise PortingError(f"{path}: alias *{event.anchor} lies inside its own anchor")
            if event.anchor not in anchors:
                raise PortingError(f"{path}: alias *{event.anchor} names no anchor before it")
            add(*anchors[event.anchor])


@functools.cache
def _loader(number_chars: int = MAX_NUMBER_CHARS):
    """PyYAML's safe loader (libyaml's parser where available) with the bounds above on numbers
    and keys; only the standard YAML types are built, never an object named by a tag."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):
        def construct_yaml_int(self, node):
            _number(node.value, number_chars)
            return super().construct_yaml_int(node)

        def construct_yaml_float(self, node):
            _number(node.value, number_chars)
            value = super().construct_yaml_float(node)
            # YAML's own spellings of infinity and NaN are data: Megatron-Bridge writes
            # `grad_norm_skip_threshold: .inf`. A literal too large for a float is not.
            if node.value.lstrip("+-").lower() in (".inf", ".nan"):
                return value
            return _finite(value, node.value)

        def flatten_mapping(self, node):
            # Every mapping passes here before its merges (<<) are spliced into it, so this sees
            # only the keys written in it; a key given again after a merge overrides by design.
            checked = self.__dict__.setdefault("_unique_checked", set())
            if id(node) not in checked:
                checked.add(id(node))
                seen = set()
                for key, _ in node.value:
                    if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                        if (key.tag, key.value) in seen:
                            raise _Refused(f"key {key.value!r} appears twice in one mapping")
                        seen.add((key.tag, key.value))
            super().flatten_mapping(node)

    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    Loader.add_constructor("tag:yaml.org,2002:float", Loader.construct_yaml_float)
    return Loader


def read_yaml(
    path: str | os.PathLike, inside: str | os.PathLike, max_bytes: int = MAX_TEXT_BYTES
) -> Any:
    """The one YAML document in ``path`` (:func:`regular_file` in ``inside``) as plain data, within
    the bounds above; its events are checked before anything is composed."""

    return parse_yaml(read_text(path, inside, max_bytes), Path(path))


def parse_yaml(text: str, path: str | os.PathLike, number_chars: int = MAX_NUMBER_CHARS) -> Any:
    """The one YAML document of ``text`` (read from ``path``, which errors name) as plain data,
    within the bounds above (``number_chars`` as for :func:`parse_json`); its events are checked
    before anything is composed."""
    import yaml

    loader = _loader(number_chars)
    try:
        _check_yaml_events(yaml.parse(text, Loader=loader), path)
        data = yaml.load(text, Loader=loader)
    except _Refused as err:
        raise PortingError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise PortingError(f"{path}: not YAML data ({_yaml_problem(err)})") from None
    except ValueError as err:  # a number past int()'s own limit, where number_chars allows it
        raise PortingError(f"{path}: not YAML data ({str(err).splitlines()[0][:200]})") from None
    _check_tree(data, path)
    return data
