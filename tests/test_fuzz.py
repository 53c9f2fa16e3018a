"""Malformed HF input to `porting import`: every case exits 2 naming the file and the field or key.

Never a traceback (exit 1), never a hang, never silent acceptance, and nothing under ``--out``.
The matrix covers safetensors headers (the reference reader's rules, huggingface/safetensors
``safetensors/src/tensor.rs``), shard indexes and files that leave the model directory, and
``config.json`` values, for both families where the field exists; a hypothesis property mutates
header bytes at random.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from porting.cli import main
from porting.convert.safetensors_io import SAFE_INDEX, SAFE_SINGLE, SafetensorsSource
from porting.errors import PortingError
from porting.testing import make_falcon, no_hang

FAMILIES = ("llama", "falcon")


@pytest.fixture(scope="module")
def falcon_src(tmp_path_factory):
    """A tiny Falcon (7B layout: MQA, parallel block, tied output)."""
    return make_falcon(tmp_path_factory.mktemp("fuzz") / "falcon")


@pytest.fixture
def sources(tiny_llama, falcon_src):
    return {"llama": tiny_llama, "falcon": falcon_src}


def _copy(sources: dict, family: str, tmp_path: Path) -> Path:
    dst = tmp_path / "models" / family
    shutil.copytree(sources[family], dst)
    return dst


def _import(capsys, src: Path, out: Path) -> tuple[int, str]:
    capsys.readouterr()
    with no_hang(60):
        code = main(["import", str(src), "--out", str(out), "--no-verify"])
    return code, capsys.readouterr().err


def _assert_refused(code: int, err: str, out: Path, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    for n in needles:
        assert n in err, f"{n!r} not in: {err}"
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


# ---------------------------------------------------------------------------------------------
# (a) safetensors headers


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)


def _by_offset(header: dict) -> list[str]:
    return sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
    )


def _victim(header: dict) -> str:
    """A 2-D weight (so shapes can be edited) in the middle of the data buffer."""
    names = [k for k in _by_offset(header) if len(header[k]["shape"]) == 2]
    return names[len(names) // 2]


# Each case rewrites model.safetensors from its (header, data) and returns what the error must
# say besides the file name: the edited tensor's name where there is one, and the problem.
HeaderCase = Callable[[Path, dict, bytes], tuple[str, ...]]


def _raw(body: bytes, *needles: str) -> HeaderCase:
    def case(f, header, data):
        _write(f, body, data)
        return needles

    return case


def _entry(edit: Callable[[dict], None], *needles: str) -> HeaderCase:
    def case(f, header, data):
        v = _victim(header)
        edit(header[v])
        _write(f, header, data)
        return (repr(v), *needles)

    return case


def _overlap(f, header, data):
    # two tensors of the same size, the later one pointed at the earlier one's bytes
    names = _by_offset(header)
    nbytes = {k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in names}
    a = next(k for k in names if [nbytes[j] for j in names].count(nbytes[k]) > 1)
    b = next(k for k in names[names.index(a) + 1 :] if nbytes[k] == nbytes[a])
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    _write(f, header, data)
    return (repr(a), repr(b), "overlaps")


def _beyond_end(f, header, data):
    # the last tensor grows by one row: consistent with its offsets, but past the end of the file
    last = _by_offset(header)[-1]
    info = header[last]
    row = 4 * (info["shape"][1] if len(info["shape"]) > 1 else 1)
    info["shape"][0] += 1
    info["data_offsets"][1] += row
    _write(f, header, data)
    return (repr(last), "truncated")


def _gap_at_start(f, header, data):
    for k in _by_offset(header):
        header[k]["data_offsets"] = [o + 4 for o in header[k]["data_offsets"]]
    _write(f, header, b"\0" * 4 + data)
    return (repr(_by_offset(header)[0]), "byte 0")


def _trailing(f, header, data):
    _write(f, header, data + b"\0" * 8)
    return ("after the last tensor",)


def _duplicate_name(f, header, data):
    v = _victim(header)
    body = json.dumps(header).encode()
    entry = json.dumps({v: header[v]}).encode()[1:-1]
    _write(f, body[:-1] + b"," + entry + b"}", data)
    return (repr(v), "twice")


def _file(content: bytes) -> HeaderCase:
    def case(f, header, data):
        f.write_bytes(content)
        return ("not a safetensors file",)

    return case


def _length_beyond_file(f, header, data):
    _write(f, header, data, length=8 + len(json.dumps(header)) + len(data))
    return ("truncated",)


def _length_over_cap(f, header, data):
    _write(f, header, data, length=100_000_001)
    return ("100000000",)


def _entry_is_list(f, header, data):
    v = _victim(header)
    header[v] = [1, 2]
    _write(f, header, data)
    return (repr(v), "must be an object")


def _metadata(value) -> HeaderCase:
    def case(f, header, data):
        header["__metadata__"] = value
        _write(f, header, data)
        return ("__metadata__",)

    return case


def _set_dim0(value) -> Callable[[dict], None]:
    def edit(entry):
        entry["shape"][0] = value

    return edit


HEADER_CASES: dict[str, HeaderCase] = {
    "json_list": _raw(b"[1, 2, 3]", "list, not an object"),
    "not_json": _raw(b'{"a": {"dtype": ', "not valid JSON"),
    "not_utf8": _raw(b'{"\xff\xfe": 1}', "not UTF-8"),
    "nan_literal": _raw(b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', "NaN"),
    "empty_file": _file(b""),
    "short_file": _file(b"\x08\0\0"),
    "length_beyond_file": _length_beyond_file,
    "length_over_cap": _length_over_cap,
    "entry_is_list": _entry_is_list,
    "entry_without_fields": _entry(lambda e: e.clear(), "lacks"),
    "missing_dtype": _entry(lambda e: e.pop("dtype"), "'dtype'"),
    "missing_shape": _entry(lambda e: e.pop("shape"), "'shape'"),
    "missing_data_offsets": _entry(lambda e: e.pop("data_offsets"), "'data_offsets'"),
    "unknown_dtype": _entry(lambda e: e.update(dtype="Q4"), "'Q4'"),
    "dtype_not_string": _entry(lambda e: e.update(dtype=4), "dtype"),
    "negative_dim": _entry(_set_dim0(-1), "shape"),
    "float_dim": _entry(_set_dim0(1.5), "shape"),
    "bool_dim": _entry(_set_dim0(True), "shape"),
    "shape_not_list": _entry(lambda e: e.update(shape="64x64"), "shape"),
    "offsets_reversed": _entry(lambda e: e["data_offsets"].reverse(), "data_offsets"),
    "offsets_three": _entry(lambda e: e["data_offsets"].append(0), "data_offsets"),
    "offsets_negative": _entry(lambda e: e["data_offsets"].__setitem__(0, -4), "data_offsets"),
    "size_not_shape": _entry(lambda e: e["shape"].__setitem__(0, e["shape"][0] + 1), "bytes"),
    "offsets_overlap": _overlap,
    "gap_at_start": _gap_at_start,
    "data_beyond_end": _beyond_end,
    "trailing_bytes": _trailing,
    "duplicate_name": _duplicate_name,
    "metadata_list": _metadata(["pt"]),
    "metadata_not_strings": _metadata({"format": 1}),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_bad_safetensors_header(sources, family, case, tmp_path, capsys):
    hf = _copy(sources, family, tmp_path)
    f = hf / SAFE_SINGLE
    header, data = _split(f)
    needles = HEADER_CASES[case](f, header, data)
    code, err = _import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", SAFE_SINGLE, *needles)


# ---------------------------------------------------------------------------------------------
# (b) shard indexes and files that are not plain files of the model directory


def _shard(hf: Path) -> tuple[Path, Path]:
    """Split model.safetensors into two shards plus an index; return the shard paths."""
    sd = load_file(hf / SAFE_SINGLE)
    keys = sorted(sd)
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2 :])
    for name, part in zip(names, halves, strict=True):
        save_file({k: sd[k] for k in part}, hf / name, metadata={"format": "pt"})
    weight_map = {k: name for name, part in zip(names, halves, strict=True) for k in part}
    (hf / SAFE_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hf / SAFE_SINGLE).unlink()
    return hf / names[0], hf / names[1]


def _edit_index(hf: Path, edit: Callable[[dict], None]) -> None:
    index = json.loads((hf / SAFE_INDEX).read_text())
    edit(index)
    (hf / SAFE_INDEX).write_text(json.dumps(index))


def _point_second_shard_at(hf: Path, second: Path, target: str) -> str:
    """Make the index send the second shard's keys to ``target``; return one such key."""
    keys = []

    def edit(index):
        for k, v in index["weight_map"].items():
            if v == second.name:
                index["weight_map"][k] = target
                keys.append(k)

    _edit_index(hf, edit)
    return keys[0]


def _outside_copy(second: Path) -> Path:
    """A copy of a shard next to the model directory (outside it)."""
    outside = second.parent.parent / "x.safetensors"
    shutil.copy(second, outside)
    return outside


def _index_absolute(hf, first, second):
    outside = _outside_copy(second)
    key = _point_second_shard_at(hf, second, str(outside))
    return (SAFE_INDEX, repr(key), "relative")


def _index_absolute_inside(hf, first, second):
    key = _point_second_shard_at(hf, second, str(second))
    return (SAFE_INDEX, repr(key), "relative")


def _index_dotdot(hf, first, second):
    _outside_copy(second)
    key = _point_second_shard_at(hf, second, "../x.safetensors")
    return (SAFE_INDEX, repr(key), "../x.safetensors")


def _index_dotdot_back_in(hf, first, second):
    key = _point_second_shard_at(hf, second, f"../{hf.name}/{second.name}")
    return (SAFE_INDEX, repr(key), "relative")


def _index_symlink_out(hf, first, second):
    outside = _outside_copy(second)
    second.unlink()
    second.symlink_to(outside)
    return (second.name, "outside the model directory")


def _index_symlinked_dir_out(hf, first, second):
    (hf.parent / "elsewhere").mkdir()
    shutil.move(second, hf.parent / "elsewhere" / second.name)
    (hf / "sub").symlink_to(hf.parent / "elsewhere")
    _point_second_shard_at(hf, second, f"sub/{second.name}")
    return (second.name, "outside the model directory")


def _index_missing_shard(hf, first, second):
    second.unlink()
    return (SAFE_INDEX, "missing", second.name)


def _index_dangling_symlink(hf, first, second):
    second.unlink()
    second.symlink_to(hf / "nowhere.safetensors")
    return (second.name, "missing")


def _index_fifo_shard(hf, first, second):
    second.unlink()
    os.mkfifo(second)
    return (second.name, "FIFO")


def _index_directory_shard(hf, first, second):
    second.unlink()
    second.mkdir()
    return (second.name, "directory")


def _index_fifo_index(hf, first, second):
    (hf / SAFE_INDEX).unlink()
    os.mkfifo(hf / SAFE_INDEX)
    return (SAFE_INDEX, "FIFO")


def _index_not_json(hf, first, second):
    (hf / SAFE_INDEX).write_text("{weight_map")
    return (SAFE_INDEX, "not valid JSON")


def _index_list(hf, first, second):
    (hf / SAFE_INDEX).write_text("[]")
    return (SAFE_INDEX, "weight_map")


def _index_weight_map_list(hf, first, second):
    _edit_index(hf, lambda i: i.update(weight_map=[first.name]))
    return (SAFE_INDEX, "weight_map")


def _index_entry_not_string(hf, first, second):
    key = _point_second_shard_at(hf, second, 7)
    return (SAFE_INDEX, repr(key))


def _index_lists_absent_tensor(hf, first, second):
    _edit_index(hf, lambda i: i["weight_map"].update({"model.surprise.weight": second.name}))
    return (second.name, "model.surprise.weight")


def _index_omits_tensor(hf, first, second):
    keys = []

    def edit(index):
        keys.append(next(k for k, v in index["weight_map"].items() if v == second.name))
        del index["weight_map"][keys[0]]

    _edit_index(hf, edit)
    return (second.name, repr(keys[0]), "not listed")


INDEX_CASES = {
    "absolute_path": _index_absolute,
    "absolute_path_inside": _index_absolute_inside,
    "dotdot_path": _index_dotdot,
    "dotdot_back_in": _index_dotdot_back_in,
    "symlink_out": _index_symlink_out,
    "symlinked_dir_out": _index_symlinked_dir_out,
    "missing_shard": _index_missing_shard,
    "dangling_symlink": _index_dangling_symlink,
    "fifo_shard": _index_fifo_shard,
    "directory_shard": _index_directory_shard,
    "fifo_index": _index_fifo_index,
    "index_not_json": _index_not_json,
    "index_list": _index_list,
    "weight_map_list": _index_weight_map_list,
    "entry_not_string": _index_entry_not_string,
    "lists_absent_tensor": _index_lists_absent_tensor,
    "omits_tensor": _index_omits_tensor,
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_bad_index_or_shard(sources, family, case, tmp_path, capsys):
    hf = _copy(sources, family, tmp_path)
    first, second = _shard(hf)
    needles = INDEX_CASES[case](hf, first, second)
    code, err = _import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", *needles)


def _single_symlink_out(hf):
    outside = hf.parent / "x.safetensors"
    shutil.move(hf / SAFE_SINGLE, outside)
    (hf / SAFE_SINGLE).symlink_to(outside)
    return (SAFE_SINGLE, "outside the model directory")


def _single_fifo(hf):
    (hf / SAFE_SINGLE).unlink()
    os.mkfifo(hf / SAFE_SINGLE)
    return (SAFE_SINGLE, "FIFO")


def _config_fifo(hf):
    (hf / "config.json").unlink()
    os.mkfifo(hf / "config.json")
    return ("config.json", "FIFO")


def _config_symlink_out(hf):
    outside = hf.parent / "config.json"
    shutil.move(hf / "config.json", outside)
    (hf / "config.json").symlink_to(outside)
    return ("config.json", "outside the model directory")


def _config_directory(hf):
    (hf / "config.json").unlink()
    (hf / "config.json").mkdir()
    return ("config.json", "directory")


def _tokenizer_fifo(hf):
    (hf / "tokenizer.json").unlink()
    os.mkfifo(hf / "tokenizer.json")
    return ("tokenizer.json", "FIFO")


def _generation_config_symlink_out(hf):
    outside = hf.parent / "generation_config.json"
    shutil.move(hf / "generation_config.json", outside)
    (hf / "generation_config.json").symlink_to(outside)
    return ("generation_config.json", "outside the model directory")


FILE_CASES = {
    "tokenizer_fifo": _tokenizer_fifo,
    "generation_config_symlink_out": _generation_config_symlink_out,
    "single_symlink_out": _single_symlink_out,
    "single_fifo": _single_fifo,
    "config_fifo": _config_fifo,
    "config_symlink_out": _config_symlink_out,
    "config_directory": _config_directory,
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_file_that_is_not_a_plain_file_of_the_model(sources, family, case, tmp_path, capsys):
    hf = _copy(sources, family, tmp_path)
    needles = FILE_CASES[case](hf)
    code, err = _import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", *needles)


def test_symlinks_inside_the_directory_and_the_hub_cache_are_read(tiny_llama, tmp_path):
    """What the containment rule must still accept: links within the model directory, and a hub
    cache snapshot whose files link to ``../../blobs`` (``huggingface_hub``'s layout)."""
    hf = tmp_path / "inside"
    shutil.copytree(tiny_llama, hf)
    (hf / "weights").mkdir()
    shutil.move(hf / SAFE_SINGLE, hf / "weights" / "w.safetensors")
    (hf / SAFE_SINGLE).symlink_to(Path("weights") / "w.safetensors")
    assert len(SafetensorsSource(hf).keys()) > 10

    entry = tmp_path / "hub" / "models--org--tiny"
    snapshot = entry / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (entry / "blobs").mkdir()
    shutil.move(hf / "weights" / "w.safetensors", entry / "blobs" / "deadbeef")
    (snapshot / SAFE_SINGLE).symlink_to(Path("../../blobs/deadbeef"))
    source = SafetensorsSource(snapshot)
    assert {source.get(k).shape for k in source.keys()}


# ---------------------------------------------------------------------------------------------
# (c) config.json

SIZE_FIELDS = {
    "llama": {
        "num_hidden_layers": False,
        "hidden_size": False,
        "intermediate_size": False,
        "num_attention_heads": False,
        "num_key_value_heads": True,  # True: null is valid (transformers derives the value)
        "head_dim": True,
        "vocab_size": False,
        "max_position_embeddings": False,
    },
    "falcon": {
        "num_hidden_layers": False,
        "hidden_size": False,
        "ffn_hidden_size": True,
        "num_attention_heads": False,
        "num_kv_heads": True,
        "vocab_size": False,
        "max_position_embeddings": False,
    },
}
BAD_SIZES = {"0": 0, "-1": -1, "true": True, "1.5": 1.5, "1.0": 1.0, "str": "4", "null": None}
EPS = {"llama": "rms_norm_eps", "falcon": "layer_norm_epsilon"}

CONFIG_CASES = [
    pytest.param(family, {field: value}, (f"{field}=",), id=f"{family}-{field}-{vid}")
    for family, fields in SIZE_FIELDS.items()
    for field, nullable in fields.items()
    for vid, value in BAD_SIZES.items()
    if not (value is None and nullable)
]
for _family in FAMILIES:
    for _field, _vid, _value in [
        ("rope_theta", "inf", float("inf")),
        ("rope_theta", "nan", float("nan")),
        ("rope_theta", "neg", -1.0),
        ("rope_theta", "zero", 0),
        ("rope_theta", "str", "1e4"),
        ("rope_theta", "null", None),
        (EPS[_family], "zero", 0.0),
        (EPS[_family], "neg", -1e-5),
        (EPS[_family], "inf", float("inf")),
        (EPS[_family], "nan", float("nan")),
        ("initializer_range", "nan", float("nan")),
        ("initializer_range", "neg", -0.02),
        ("attention_dropout", "one", 1.0),
        ("attention_dropout", "neg", -0.1),
        ("attention_dropout", "nan", float("nan")),
        ("attention_dropout", "true", True),
        ("tie_word_embeddings", "str", "false"),
        ("tie_word_embeddings", "int", 0),
    ]:
        CONFIG_CASES.append(
            pytest.param(
                _family, {_field: _value}, (f"{_field}=",), id=f"{_family}-{_field}-{_vid}"
            )
        )
CONFIG_CASES += [
    pytest.param(
        "llama",
        {"architectures": ["LlamaForCausalLM", "MistralForCausalLM"]},
        ("architectures", "'MistralForCausalLM'", "one architecture"),
        id="llama-two-architectures",
    ),
    pytest.param(
        "falcon",
        {"architectures": ["FalconForCausalLM", "LlamaForCausalLM"]},
        ("architectures", "'LlamaForCausalLM'", "one architecture"),
        id="falcon-two-architectures",
    ),
    pytest.param(
        "llama", {"architectures": [7]}, ("architectures", "[7]"), id="llama-architecture-int"
    ),
    pytest.param(
        "llama",
        {"num_key_value_heads": 3},
        ("num_key_value_heads=3", "num_attention_heads=4"),
        id="llama-kv-not-dividing",
    ),
    pytest.param(
        "falcon",
        {"new_decoder_architecture": True, "num_kv_heads": 3},
        ("num_kv_heads=3", "num_attention_heads=4"),
        id="falcon-kv-not-dividing",
    ),
    pytest.param(
        "falcon",
        {"num_attention_heads": 3},
        ("num_attention_heads=3", "hidden_size=64"),
        id="falcon-heads-3",
    ),
    pytest.param(
        "falcon",
        {"num_ln_in_parallel_attn": True},
        ("num_ln_in_parallel_attn=True",),
        id="falcon-num-ln-true",
    ),
    pytest.param(
        "falcon", {"hidden_dropout": False}, ("hidden_dropout=False",), id="falcon-dropout-false"
    ),
    pytest.param(
        "llama",
        {"rope_scaling": {"rope_type": "linear"}},
        ("rope_scaling.factor", "not None"),
        id="llama-rope-scaling-without-factor",
    ),
]


def _set_config(hf: Path, changes: dict) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    # allow_nan (the default) writes the NaN / Infinity literals that Python's json reads back
    (hf / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("family,changes,needles", CONFIG_CASES)
def test_bad_config_value(sources, family, changes, needles, tmp_path, capsys):
    hf = _copy(sources, family, tmp_path)
    _set_config(hf, changes)
    code, err = _import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", "config.json", *needles)


@pytest.mark.parametrize(
    "text,needles",
    [
        ('["LlamaForCausalLM"]', ("must be a JSON object", "list")),
        ("42", ("must be a JSON object",)),
        ("{", ("not valid JSON",)),
        ('{"a": 1, "a": 2}', ("'a' appears twice",)),
        ("[" * 100_000 + "]" * 100_000, ("nested deeper than",)),
    ],
    ids=["list", "number", "truncated", "duplicate-key", "deep-nesting"],
)
def test_config_json_that_is_not_an_object(tiny_llama, text, needles, tmp_path, capsys):
    hf = _copy({"llama": tiny_llama}, "llama", tmp_path)
    (hf / "config.json").write_text(text)
    code, err = _import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", "config.json", *needles)


def test_config_json_not_utf8(tiny_llama, tmp_path, capsys):
    hf = _copy({"llama": tiny_llama}, "llama", tmp_path)
    (hf / "config.json").write_bytes(b'{"architectures": ["\xff"]}')
    code, err = _import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", "config.json", "UTF-8")


def test_fewer_heads_than_the_weights_have(tiny_llama, tmp_path, capsys):
    """2 heads of 16 against 4-head weights: refused from the headers, before any tensor is
    read, naming a layer-0 attention tensor, its shape and the one the config gives it.

    The model builds (head_dim is explicit, and 2 divides the width as transformers 5 checks), so
    this is the headers against the config.
    """
    hf = _copy({"llama": tiny_llama}, "llama", tmp_path)
    _set_config(hf, {"num_attention_heads": 2, "num_key_value_heads": 1})
    code, err = _import(capsys, hf, tmp_path / "out")
    _assert_refused(
        code,
        err,
        tmp_path / "out",
        "model.safetensors: tensor 'model.layers.0.self_attn.",
        "config.json makes it",
    )


def test_qkv_of_the_wrong_head_count_names_target_sources_and_shapes():
    """The QKV transform checks its inputs before reshaping; the engine names target and sources
    (a reshape would otherwise fail inside torch with a RuntimeError naming neither)."""
    from porting.contract.mapping import Fused
    from porting.contract.transforms import QKV
    from porting.convert.mapping import import_weights

    tensors = {
        "q": torch.zeros(64, 64),  # 4 heads of 16
        "k": torch.zeros(16, 64),
        "v": torch.zeros(16, 64),
    }

    class Source:
        def keys(self):
            return list(tensors)

        def get(self, key):
            return tensors[key]

    ctx = SimpleNamespace(num_heads=3, num_query_groups=1, head_dim=16)
    with pytest.raises(PortingError) as err:
        import_weights(
            Source(), {"qkv": torch.empty(80, 64)}, [Fused(("q", "k", "v"), "qkv", QKV)], ctx, 1
        )
    for needle in ("'qkv'", "q (64, 64)", "k (16, 64)", "expected (48, 64)", "num_heads=3"):
        assert needle in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------
# random header mutations


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny Llama whose header is mutated per example (built here: hypothesis reuses it)."""
    from porting.testing import make_llama

    return make_llama(tmp_path_factory.mktemp("fuzz") / "pristine", num_layers=1)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_header_mutations_are_read_or_refused_by_name(pristine, capsys, data):
    """Flipping bytes of the length prefix or the JSON header: the file is either still a valid
    safetensors file whose every tensor reads, or refused with exit 2 naming it.

    A mutation can leave a valid file (inside a tensor name or the metadata); the import of such a
    file is the ordinary path the family tests cover, and running it here would cost a full
    conversion per example, so those are checked by reading every tensor instead.
    """
    raw = (pristine / SAFE_SINGLE).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    edits = data.draw(
        st.lists(st.tuples(st.integers(0, 8 + n - 1), st.integers(0, 255)), min_size=1, max_size=4)
    )
    mutated = bytearray(raw)
    for pos, byte in edits:
        mutated[pos] = byte
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        shutil.copytree(pristine, hf)
        (hf / SAFE_SINGLE).write_bytes(bytes(mutated))
        try:
            source = SafetensorsSource(hf)
        except PortingError as err:
            event("refused")
            assert SAFE_SINGLE in str(err)
            code, out = _import(capsys, hf, Path(tmp) / "out")
            _assert_refused(code, out, Path(tmp) / "out", SAFE_SINGLE)
        else:
            event("still valid")
            for k in source.keys():
                source.get(k)
