"""Hostile files inside a checkpoint of each layout: every one refused before it costs anything.

What `porting export` and `porting verify` read from a checkpoint (NeMo 2, Megatron-LM,
Megatron-Bridge; ours or, with ``--hf-config``, trained elsewhere), planted one at a time:

- text files (``run_config.yaml``, the tracker, ``porting.json``, ``io.json``, ``metadata.json``,
  the tokenizer's and HF extra JSON) that are bombs, deeply nested, oversize, not UTF-8, or hold
  numbers no parser should take (5000 digits, ``1e999999``, ``NaN``), duplicate keys, tags;
- every file and directory a checkpoint names replaced by a symlink to an outside copy, a symlink
  to ``/dev/zero``, a FIFO, a device node, or reached through a symlinked directory;
- ``.metadata`` recording a tensor shape that is too big, of the wrong rank, negative, not an
  integer, or off from the config in one dimension, for every kind of tensor; chunks that
  overlap; a record or ``common.pt`` whose zip members are compressed.

Each case must exit 2 with one line naming the file and the problem, no traceback, within two
minutes (a FIFO opened for reading would block for ever; the first case imports NeMo), with
nothing written and the checkpoint and anything it links to unchanged.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from porting.api import import_hf
from porting.cli import main
from porting.convert.dist_reader import read_metadata
from porting.testing import no_hang

LAYOUTS = ("nemo2", "megatron-lm", "megatron-bridge")
MEGATRON = ("megatron-lm", "megatron-bridge")


@pytest.fixture(scope="module")
def layouts(tiny_llama, tiny_nemo, tmp_path_factory):
    """``{format: checkpoint}`` of ``tiny_llama`` in all three layouts (each import gated)."""
    root = tmp_path_factory.mktemp("hostile-layouts")
    out = {"nemo2": tiny_nemo}
    for fmt in MEGATRON:
        out[fmt] = root / fmt
        import_hf(tiny_llama, out[fmt], fmt=fmt, show_progress=False)
    return out


def _snapshot(*roots: Path) -> dict:
    """Every entry under ``roots`` (links not followed): its kind and content or target."""
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                mode = os.lstat(p).st_mode
                if stat.S_ISLNK(mode):
                    out[p] = ("link", os.readlink(p))
                elif stat.S_ISREG(mode):
                    out[p] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
                else:
                    out[p] = (stat.S_IFMT(mode),)
    return out


def _weights(ckpt: Path) -> Path:
    return ckpt / ("weights" if (ckpt / "weights").is_dir() else "iter_0000000")


def _meta(ckpt: Path) -> Path:
    return ckpt / ("context" if (ckpt / "context").is_dir() else "porting")


def _tokenizer(ckpt: Path) -> Path:
    meta = _meta(ckpt)
    return meta / ("nemo_tokenizer" if meta.name == "context" else "tokenizer")


def _refused(
    ckpt: Path,
    hf: Path,
    tmp_path: Path,
    capsys,
    names: tuple[str, ...],
    problems: tuple[str, ...],
    foreign: bool = False,
) -> None:
    """``export`` and ``verify`` of ``ckpt`` (against the HF directory ``hf``) both exit 2 with one
    error line holding every one of ``names`` and one of ``problems``, leave no output and change
    nothing under ``ckpt`` or ``tmp_path/outside`` (where links point)."""
    watched = [p for p in (ckpt, tmp_path / "outside") if p.exists()]
    before = _snapshot(*watched)
    flags = ["--hf-config", str(hf)] if foreign else []
    out = tmp_path / "out"
    for argv in (["export", str(ckpt), "--out", str(out)], ["verify", str(hf), str(ckpt)]):
        capsys.readouterr()
        with no_hang():
            code = main(argv + flags)
        err = capsys.readouterr().err
        assert code == 2, err
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith(f"porting {argv[0]}: error")]
        assert len(lines) == 1, err
        for name in names:
            assert name in lines[0], f"{name!r} not in: {lines[0]}"
        assert any(p in lines[0] for p in problems), f"none of {problems} in: {lines[0]}"
        assert not out.exists() and not list(tmp_path.glob(".out*")), err
    assert _snapshot(*watched) == before


def _copy(layouts, fmt: str, tmp_path: Path, foreign: bool = False) -> Path:
    ckpt = shutil.copytree(layouts[fmt], tmp_path / "ck", symlinks=True)
    if foreign:
        shutil.rmtree(ckpt / "porting")
    return ckpt


# --- text files ----------------------------------------------------------------------------------

# (name, what it does to a JSON object's text, the problem the error must name)
_JSON: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("deep", lambda t: b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b", " + t[1:], "nested deeper"),
    (
        "deep-objects",
        lambda t: b'{"x": ' + b'{"a": ' * 300 + b"1" + b"}" * 300 + b", " + t[1:],
        "nested deeper",
    ),
    ("5000-digits", lambda t: b'{"x": ' + b"7" * 5000 + b", " + t[1:], "5000 characters"),
    ("1e999999", lambda t: b'{"x": 1e999999, ' + t[1:], "1e999999 is not finite"),
    ("duplicate-key", lambda t: b'{"x": 1, "x": 2, ' + t[1:], "'x' appears twice"),
    ("not-utf8", lambda t: b'{"x": "\xff\xfe", ' + t[1:], "not UTF-8"),
    ("lone-surrogate", lambda t: b'{"x": "\\ud800", ' + t[1:], "not Unicode text"),
    ("truncated", lambda t: t[: len(t) // 2], "not valid JSON"),
]


def _json_files(ckpt: Path) -> dict[str, Path]:
    files = {
        "porting.json": _meta(ckpt) / "porting.json",
        "metadata.json": _weights(ckpt) / "metadata.json",
        "generation_config.json": _meta(ckpt) / "hf_extra" / "generation_config.json",
        "tokenizer_config.json": _tokenizer(ckpt) / "tokenizer_config.json",
    }
    if (ckpt / "context").is_dir():
        files["io.json"] = ckpt / "context" / "io.json"
    return files


_JSON_FILES = ("porting.json", "metadata.json", "generation_config.json", "tokenizer_config.json")


@pytest.mark.parametrize(
    "fmt,name",
    [(fmt, name) for fmt in LAYOUTS for name in _JSON_FILES] + [("nemo2", "io.json")],
)
@pytest.mark.parametrize("variant", _JSON, ids=[v[0] for v in _JSON])
def test_hostile_json_in_a_checkpoint_is_refused(
    layouts, tiny_llama, tmp_path, capsys, fmt, name, variant
):
    ckpt = _copy(layouts, fmt, tmp_path)
    path = _json_files(ckpt)[name]
    _, edit, problem = variant
    path.write_bytes(edit(path.read_bytes()))
    _refused(ckpt, tiny_llama, tmp_path, capsys, (str(path),), (problem,))


def test_oversize_json_is_refused_before_it_is_read(layouts, tiny_llama, tmp_path, capsys):
    ckpt = _copy(layouts, "megatron-lm", tmp_path)
    path = _meta(ckpt) / "porting.json"
    with open(path, "ab") as f:
        f.truncate((16 << 20) + 1)  # a sparse tail: no disk, and nothing is read to find its size
    _refused(ckpt, tiny_llama, tmp_path, capsys, (str(path),), ("more than the 16777216",))


_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)

# (name, text appended to run_config.yaml or replacing it, the problem the error must name)
_YAML: list[tuple[str, str | bytes, str]] = [
    ("billion-laughs", _BOMB, "expands to more than 1000000 nodes"),
    ("deep-flow", "x: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper"),
    ("deep-flow-mappings", "x: " + "{a: " * 500 + "1" + "}" * 500 + "\n", "nested deeper"),
    ("deep-block", "x:\n" + "".join("  " * i + "- \n" for i in range(1, 200)), "nested deeper"),
    (
        "deep-aliases",
        "x0: &x0 [1]\n" + "".join(f"x{i}: &x{i} [*x{i - 1}]\n" for i in range(1, 200)),
        "nested deeper",
    ),
    (
        "merge-chain",
        "m0: &m0 {k0: 1}\n"
        + "".join(f"m{i}: &m{i} {{<<: *m{i - 1}, k{i}: 1}}\n" for i in range(1, 200)),
        "nested deeper",
    ),
    ("recursive-alias", "x: &x [*x]\n", "alias *x lies inside its own anchor"),
    ("duplicate-key", "model: {}\n", "'model' appears twice"),
    ("5000-digits", "x: " + "7" * 5000 + "\n", "5000 characters"),
    ("hex-digits", "x: 0x" + "f" * 5000 + "\n", "characters"),
    ("overflowing-float", "x: 1.0e+999999\n", "1.0e+999999 is not finite"),
    ("python-tag", "x: !!python/object/apply:os.system [touch HACKED]\n", "python/object/apply"),
    ("local-tag", "x: !shell rm\n", "'!shell'"),
    ("second-document", "---\nx: 1\n", "another document"),
    ("not-utf8", b"x: \xff\xfe\n", "not UTF-8"),
]


@pytest.mark.parametrize("variant", _YAML, ids=[v[0] for v in _YAML])
def test_hostile_run_config_is_refused(layouts, tiny_llama, tmp_path, capsys, variant, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _copy(layouts, "megatron-bridge", tmp_path)
    path = _weights(ckpt) / "run_config.yaml"
    _, tail, problem = variant
    path.write_bytes(path.read_bytes() + (tail if isinstance(tail, bytes) else tail.encode()))
    # libyaml stops at 1000 levels on its own, in its words
    problems = (problem, "maximum nesting depth") if problem == "nested deeper" else (problem,)
    _refused(ckpt, tiny_llama, tmp_path, capsys, (str(path),), problems)
    assert not (tmp_path / "HACKED").exists()


def test_yaml_infinity_and_nan_are_data(tmp_path):
    """Megatron-Bridge writes `grad_norm_skip_threshold: .inf`; YAML's spellings of infinity and
    NaN are read as floats, while a literal too large for one is refused."""
    import math

    from porting.errors import PortingError
    from porting.untrusted import read_yaml

    path = tmp_path / "run_config.yaml"
    path.write_text("a: .inf\nb: -.Inf\nc: .NaN\nd: 1.5\n")
    data = read_yaml(path, tmp_path)
    assert data["a"] == math.inf and data["b"] == -math.inf and math.isnan(data["c"])
    path.write_text("a: 1.0e+999999\n")
    with pytest.raises(PortingError, match="not finite"):
        read_yaml(path, tmp_path)


def test_oversize_run_config_is_refused(layouts, tiny_llama, tmp_path, capsys):
    ckpt = _copy(layouts, "megatron-bridge", tmp_path)
    path = _weights(ckpt) / "run_config.yaml"
    with open(path, "ab") as f:
        f.truncate((4 << 20) + 1)
    _refused(ckpt, tiny_llama, tmp_path, capsys, (str(path),), ("more than the 4194304",))


@pytest.mark.parametrize(
    "text,problem",
    [
        ("7" * 5000, "more than the 64"),
        ("7" * 19, "not an iteration number"),
        ("\u00b2", "not an iteration number"),
        ("\u0663", "not an iteration number"),  # ARABIC-INDIC DIGIT THREE: str.isdigit() says yes
        ("-1", "not an iteration number"),
        ("1e3", "not an iteration number"),
        ("0 0", "not an iteration number"),
        ("", "not an iteration number"),
        ("\udcff", "not UTF-8"),
    ],
    ids=[
        "5000-digits",
        "19-digits",
        "superscript",
        "arabic-digit",
        "negative",
        "exponent",
        "two",
        "empty",
        "not-utf8",
    ],
)
@pytest.mark.parametrize("fmt", MEGATRON)
def test_a_bad_tracker_is_one_line(layouts, tiny_llama, tmp_path, capsys, fmt, text, problem):
    ckpt = _copy(layouts, fmt, tmp_path)
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(text.encode("utf-8", "surrogateescape"))
    _refused(ckpt, tiny_llama, tmp_path, capsys, (str(tracker),), (problem,))


def test_hostile_yaml_costs_no_time(tmp_path):
    """The bomb is refused from its parser events, before anything is composed or walked."""
    import time

    from porting.errors import PortingError
    from porting.untrusted import read_yaml

    path = tmp_path / "bomb.yaml"
    path.write_text(_BOMB + "".join(f"z{i}: &z{i} [*i, *i]\n" for i in range(40)))
    started = time.perf_counter()
    with pytest.raises(PortingError, match="expands to more than"):
        read_yaml(path, tmp_path)
    assert time.perf_counter() - started < 5


def test_yaml_anchors_and_merges_within_bounds_are_data(tmp_path):
    from porting.untrusted import read_yaml

    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\nl: [*b, *b]\n")
    data = read_yaml(path, tmp_path)
    assert data["d"] == {"x": 3, "y": 2} and data["l"] == [{"x": 1, "y": 2}] * 2


# --- files a checkpoint names --------------------------------------------------------------------


def _named_files(ckpt: Path) -> dict[str, Path]:
    """Every file or directory of ``ckpt`` that export or verify opens, by a short name."""
    weights = _weights(ckpt)
    files = {
        ".metadata": weights / ".metadata",
        "shard": weights / "__0_0.distcp",
        "other-shard": weights / "__0_1.distcp",
        "metadata.json": weights / "metadata.json",
        "porting.json": _meta(ckpt) / "porting.json",
        "tokenizer.json": _tokenizer(ckpt) / "tokenizer.json",
        "generation_config.json": _meta(ckpt) / "hf_extra" / "generation_config.json",
        "weights-dir": weights,
        "meta-dir": _meta(ckpt),
        "tokenizer-dir": _tokenizer(ckpt),
    }
    if weights.name == "weights":
        files["io.json"] = ckpt / "context" / "io.json"
    else:
        files["tracker"] = ckpt / "latest_checkpointed_iteration.txt"
        files["common.pt"] = weights / "common.pt"
        if (weights / "run_config.yaml").exists():
            files["run_config.yaml"] = weights / "run_config.yaml"
    return files


_COMMON = (".metadata", "shard", "other-shard", "metadata.json", "porting.json", "tokenizer.json")
_COMMON += ("generation_config.json", "weights-dir", "meta-dir", "tokenizer-dir")
_NAMED = {
    "nemo2": _COMMON + ("io.json",),
    "megatron-lm": _COMMON + ("tracker", "common.pt"),
    "megatron-bridge": _COMMON + ("tracker", "common.pt", "run_config.yaml"),
}
# What the one error line may call each plant.
_LINK = ("symbolic link", "outside the checkpoint", "leaves", "only regular files")
_PROBLEMS = {
    "symlink-outside": _LINK,
    "symlink-dev-zero": _LINK,
    "fifo": ("is a FIFO", "only regular files"),
    "null-device": ("is a character device", "only regular files"),
    "through-symlinked-dir": _LINK,
}


@pytest.mark.parametrize(
    "fmt,name,kind",
    [
        (fmt, name, kind)
        for fmt, names in _NAMED.items()
        for name in names
        for kind in _PROBLEMS
        if not (name.endswith("-dir") and kind in ("fifo", "null-device"))
        # the tracker's directory is the checkpoint itself, which the user may name by a link
        and not (name in ("tracker", "weights-dir", "meta-dir") and kind == "through-symlinked-dir")
    ],
)
def test_files_a_checkpoint_names_must_be_its_own_regular_files(
    layouts, tiny_llama, tmp_path, capsys, fmt, name, kind
):
    ckpt = _copy(layouts, fmt, tmp_path)
    path = _named_files(ckpt)[name]
    outside = tmp_path / "outside"
    outside.mkdir()
    if kind == "through-symlinked-dir":  # its directory a link to a copy outside the checkpoint
        path = path.parent
    copy = outside / path.name
    # A valid copy, so that only the link is wrong.
    if path.is_dir():
        shutil.copytree(path, copy, symlinks=True)
        shutil.rmtree(path)
    else:
        shutil.copyfile(path, copy)
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "null-device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("making a device node needs CAP_MKNOD")
    else:
        path.symlink_to("/dev/zero" if kind == "symlink-dev-zero" else copy)
    # named by its path in the checkpoint (the tokenizer's directory: as the manifest gives it)
    _refused(ckpt, tiny_llama, tmp_path, capsys, (str(path.relative_to(ckpt)),), _PROBLEMS[kind])


@pytest.mark.parametrize("fmt", MEGATRON)
def test_an_iteration_directory_that_is_a_link_is_refused(
    layouts, tiny_llama, tmp_path, capsys, fmt
):
    ckpt = _copy(layouts, fmt, tmp_path)
    (ckpt / "iter_0000000").rename(ckpt / "iter_0000001")
    (ckpt / "iter_0000000").symlink_to("iter_0000001")  # even one that stays inside
    _refused(ckpt, tiny_llama, tmp_path, capsys, (str(ckpt / "iter_0000000"),), ("symbolic link",))


def test_a_hard_link_is_the_file_itself_and_is_read(layouts, tmp_path, capsys):
    """Checkpoints copied with ``cp -al`` are made of hard links; one cannot be told from the
    file (docs/security.md)."""
    ckpt = tmp_path / "ck"
    shutil.copytree(layouts["megatron-lm"], ckpt, copy_function=os.link)
    code = main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--no-verify"])
    assert code == 0, capsys.readouterr().err


# --- shapes in .metadata -------------------------------------------------------------------------

_TENSORS = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "decoder.layers.self_attention.linear_qkv.weight",
    "decoder.layers.mlp.linear_fc1.weight",
    "decoder.final_layernorm.weight",
)


def _huge(shape):
    return (2**40,) + tuple(shape[1:])


def _one_more(shape):
    return tuple(shape[:-1]) + (shape[-1] + 1,)


def _one_less(shape):
    return (shape[0] - 1,) + tuple(shape[1:])


# (name, the new global shape from the old, whether its one chunk says the same too)
def _shared_lists(levels: int) -> list:
    x: list = []
    for _ in range(levels):
        x = [x, x]
    return x


_SHAPES = [
    ("huge", _huge, False),
    ("huge-with-its-chunk", _huge, True),
    ("last-dim-plus-one", _one_more, True),
    ("first-dim-minus-one", _one_less, True),
    ("extra-axis", lambda s: tuple(s) + (1,), True),
    ("merged-axes", lambda s: (s[0] * s[1], *s[2:]) if len(s) > 1 else (), True),
    ("reversed", lambda s: tuple(reversed(s)), True),
    ("negative", lambda s: (-1, *s[1:]), True),
    ("float", lambda s: (float(s[0]), *s[1:]), True),
    ("bool", lambda s: (True, *s[1:]), True),
    ("rank-40", lambda s: (1,) * 40, True),
    # a few hundred pickled bytes whose repr is 2**60 items long: no message may print it whole
    ("shared-lists", lambda s: _shared_lists(60), False),
]
# How the one error line may say it: against the bytes stored, against the chunks, against the
# config (per tensor, or as the layer count the manifest names), or the shape itself; a foreign
# checkpoint's vocabulary is its embedding's rows, so a wrong embedding is also caught against
# --hf-config's vocab_size.
_SHAPE_PROBLEMS = ("needs", "chunks hold", "makes it", "integers >= 0", "embedding", "layers (")


def _edit_shape(weights: Path, key: str, make, chunk_too: bool) -> None:
    """Record ``key`` in ``weights/.metadata`` with the shape ``make`` gives from its own; with
    ``chunk_too``, as one chunk of that shape stored where its first chunk was."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = read_metadata(weights)
    meta = md.state_dict_metadata[key]
    new = make(tuple(meta.size))
    meta.size = torch.Size(new) if all(type(d) is int for d in new) else new
    if chunk_too:
        first = md.storage_data[MetadataIndex(key, meta.chunks[0].offsets)]
        for chunk in meta.chunks:
            del md.storage_data[MetadataIndex(key, chunk.offsets)]
        zeros = torch.Size([0] * len(new))
        meta.chunks = [ChunkStorageMetadata(zeros, meta.size)]
        md.storage_data[MetadataIndex(key, zeros)] = first
    with open(weights / ".metadata", "wb") as f:
        pickle.dump(md, f)


# A one-axis shape reversed is itself: not a case.
_SHAPE_CASES = [
    (tensor, variant)
    for tensor in _TENSORS
    for variant in _SHAPES
    if not (variant[0] == "reversed" and tensor == "decoder.final_layernorm.weight")
]


@pytest.mark.parametrize("source", [*LAYOUTS, "megatron-lm --hf-config"])
@pytest.mark.parametrize(
    "tensor,variant", _SHAPE_CASES, ids=[f"{v[0]}-{t}" for t, v in _SHAPE_CASES]
)
def test_a_recorded_shape_that_is_not_the_config_s_is_refused_by_name(
    layouts, tiny_llama, tmp_path, capsys, source, tensor, variant
):
    fmt, _, flag = source.partition(" ")
    foreign = bool(flag)
    ckpt = _copy(layouts, fmt, tmp_path, foreign)
    prefix = "module." if fmt == "nemo2" else ""
    name, make, chunk_too = variant
    _edit_shape(_weights(ckpt), prefix + tensor, make, chunk_too)
    # The file and the tensor; a foreign embedding may be caught as the vocabulary it implies.
    names = () if foreign and tensor.startswith("embedding") else (str(_weights(ckpt)), tensor)
    _refused(ckpt, tiny_llama, tmp_path, capsys, names, _SHAPE_PROBLEMS, foreign)


def test_overlapping_chunks_leave_no_hole(layouts, tmp_path):
    """Two chunks over the same rows add up to the tensor's size but leave the other rows unread:
    a read never returns memory nobody wrote."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from porting.convert.dist_reader import DistCheckpointReader
    from porting.errors import PortingError

    ckpt = _copy(layouts, "megatron-lm", tmp_path)
    weights = _weights(ckpt)
    md = read_metadata(weights)
    key = "output_layer.weight"
    meta = md.state_dict_metadata[key]
    rows, cols = meta.size
    info = md.storage_data[MetadataIndex(key, torch.Size([0, 0]))]
    half = rows // 2
    meta.chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([half, cols])),
        ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([half, cols])),
    ]
    md.storage_data[MetadataIndex(key, torch.Size([1, 0]))] = info
    with open(weights / ".metadata", "wb") as f:
        pickle.dump(md, f)
    reader = DistCheckpointReader(weights)
    with pytest.raises(PortingError, match="overlap"):
        reader.read(key, (0, 0), (rows, cols))


def _rezip(raw: bytes, compress: Callable[[str], bool]) -> bytes:
    """The zip ``raw`` with the members ``compress`` names deflated (torch.save stores all)."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w") as dst:
        for member in src.infolist():
            kind = zipfile.ZIP_DEFLATED if compress(member.filename) else zipfile.ZIP_STORED
            dst.writestr(member.filename, src.read(member), compress_type=kind)
    return out.getvalue()


@pytest.mark.parametrize("fmt", MEGATRON)
def test_a_compressed_common_pt_is_refused(layouts, tiny_llama, tmp_path, capsys, fmt):
    ckpt = _copy(layouts, fmt, tmp_path)
    path = _weights(ckpt) / "common.pt"
    path.write_bytes(_rezip(path.read_bytes(), lambda name: name.endswith("data.pkl")))
    _refused(ckpt, tiny_llama, tmp_path, capsys, (str(path),), ("is compressed",))


@pytest.mark.parametrize("fmt", LAYOUTS)
def test_a_shard_record_with_a_compressed_member_is_refused(
    layouts, tiny_llama, tmp_path, capsys, fmt
):
    """A deflated pickle inside a record could inflate into any size when read."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    ckpt = _copy(layouts, fmt, tmp_path)
    weights = _weights(ckpt)
    md = read_metadata(weights)
    key = ("module." if fmt == "nemo2" else "") + "decoder.final_layernorm.weight"
    index = MetadataIndex(key, md.state_dict_metadata[key].chunks[0].offsets)
    info = md.storage_data[index]
    with open(weights / info.relative_path, "rb") as f:
        f.seek(info.offset)
        record = _rezip(f.read(info.length), lambda name: name.endswith("data.pkl"))
    (weights / "__9_0.distcp").write_bytes(record)
    info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(record)
    with open(weights / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _refused(ckpt, tiny_llama, tmp_path, capsys, ("__9_0.distcp", key), ("compressed",))
