"""What a user gets on bad input: exit status 2, a message naming the file/key/field, no output."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting.cli import main
from porting.testing import make_llama


@pytest.fixture
def hf(tiny_llama, tmp_path):
    """A private copy of the tiny model that a test may damage."""
    dst = tmp_path / "hf"
    shutil.copytree(tiny_llama, dst)
    return dst


def _run_import(capsys, src, out, *extra):
    code = main(["import", str(src), "--out", str(out), "--no-verify", *extra])
    return code, capsys.readouterr().err


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _assert_refused(code, err, out, *needles):
    assert code == 2, err
    for n in needles:
        assert n in err, err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def test_missing_config_json(hf, tmp_path, capsys):
    (hf / "config.json").unlink()
    code, err = _run_import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", "config.json: missing")


def test_unknown_architecture_lists_known_ones(hf, tmp_path, capsys):
    _edit_config(hf, architectures=["MambaForCausalLM"])
    code, err = _run_import(capsys, hf, tmp_path / "out")
    _assert_refused(
        code,
        err,
        tmp_path / "out",
        "'MambaForCausalLM'",
        "installed families: ",
        "llama (LlamaForCausalLM)",
    )


def test_missing_shard_is_named(tmp_path, capsys):
    src = make_llama(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    code, err = _run_import(capsys, src, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", "missing", shards[1].name)


def test_truncated_safetensors_is_named(hf, tmp_path, capsys):
    f = hf / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    code, err = _run_import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", "model.safetensors", "truncated")


def test_wrong_shape_tensor_is_named(hf, tmp_path, capsys):
    sd = load_file(hf / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 50)
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    code, err = _run_import(capsys, hf, tmp_path / "out")
    _assert_refused(
        code,
        err,
        tmp_path / "out",
        "model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' is (64, 50)",
        "config.json makes it (64, 98)",
    )


def test_extra_unknown_key_is_named(hf, tmp_path, capsys):
    sd = load_file(hf / "model.safetensors")
    sd["model.layers.0.mlp.surprise.weight"] = torch.zeros(3)
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    code, err = _run_import(capsys, hf, tmp_path / "out")
    _assert_refused(
        code, err, tmp_path / "out", "model.layers.0.mlp.surprise.weight", "not in the mapping"
    )


def test_existing_output_is_refused_without_overwrite(hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, err = _run_import(capsys, hf, out)
    assert code == 2 and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "precious"


def test_failed_overwrite_keeps_the_old_output(hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    sd = load_file(hf / "model.safetensors")
    sd["model.norm.weight"] = torch.zeros(65)
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    code, err = _run_import(capsys, hf, out, "--overwrite")
    assert code == 2 and "tensor 'model.norm.weight' is (65,)" in err
    assert (out / "keep.txt").read_text() == "precious"


def test_pickle_checkpoint_refused_unless_opted_in(hf, tmp_path, capsys):
    sd = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    torch.save(sd, hf / "pytorch_model.bin")
    code, err = _run_import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", "pickle", "--allow-pickle")
    code = main(["import", str(hf), "--out", str(tmp_path / "out"), "--allow-pickle"])
    assert code == 0 and (tmp_path / "out" / "context" / "porting.json").exists()


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"attention_bias": True, "mlp_bias": False}, ["attention_bias=True", "mlp_bias=False"]),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, ["rope_scaling", "dynamic"]),
        ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "SwiGLU"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads=3", "num_attention_heads=4"]),
        ({"sliding_window": 128}, ["unsupported field", "sliding_window"]),
        ({"pretraining_tp": 2}, ["pretraining_tp=2"]),
    ],
    ids=["bias_mix", "rope_dynamic", "gelu", "kv_not_dividing", "unknown_field", "pretraining_tp"],
)
def test_config_lint_names_the_field(hf, tmp_path, capsys, changes, needles):
    _edit_config(hf, **changes)
    code, err = _run_import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", *needles)


def test_mixed_dtypes_need_an_explicit_dtype(hf, tmp_path, capsys):
    sd = load_file(hf / "model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.bfloat16)
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    code, err = _run_import(capsys, hf, tmp_path / "out")
    _assert_refused(code, err, tmp_path / "out", "mix dtypes", "bfloat16", "float32", "--dtype")


def test_export_of_a_foreign_checkpoint_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "foreign"
    (ckpt / "context").mkdir(parents=True)
    (ckpt / "weights").mkdir()
    code = main(["export", str(ckpt), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    _assert_refused(code, err, tmp_path / "out", "porting.json", "not written by `porting import`")


def test_export_of_a_missing_directory(tmp_path, capsys):
    code = main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    _assert_refused(code, capsys.readouterr().err, tmp_path / "out", "not a directory")


def test_verify_reports_json(tiny_llama, tiny_nemo, capsys):
    code = main(["verify", str(tiny_llama), str(tiny_nemo), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["top1_agreement"] == 1.0
    assert report["positions"] > 100 and report["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32])
def test_a_weight_of_a_dtype_torch_cannot_read_as_itself_is_refused_by_name(tmp_path, dtype):
    """The reader maps each tensor itself (porting.pages): a stored dtype it does not list is
    refused naming the file, the tensor and the dtype, not read as something else."""
    from porting.convert.safetensors_io import SafetensorsSource
    from porting.errors import PortingError

    save_file({"w": torch.zeros(4, 4, dtype=dtype)}, tmp_path / "model.safetensors")
    source = SafetensorsSource(tmp_path, hf_config={})
    with pytest.raises(
        PortingError, match=r"model\.safetensors: tensor 'w' has dtype U(16|32), not"
    ):
        source.get("w")
