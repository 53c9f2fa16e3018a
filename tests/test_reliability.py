"""Reliability, round three: what a config or an output name says cannot exhaust memory, destroy
an input, or slip a wrong dataset into training; non-finite numbers are named; a full disk is one
located line (docs/security.md lists each guarantee and the test that holds it).

Every case runs the real command (`porting.cli.main`, or a child process where a file system or
a signal is involved) and checks its exit status, its one-line message, and what it left behind.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting.cli import main
from porting.testing import on_a_small_disk, with_edited_manifest


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def _edited_hf(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _edited_ckpt(src: Path, dst: Path, **changes) -> Path:
    return with_edited_manifest(src, dst, lambda data: data["hf_config"].update(changes))


# A library's warning on its first import, through NeMo's logger: printed in this worker by
# whichever case first imports that library (modelopt, after tests/test_gate.py's cases); what a
# fresh process prints is tests/test_output.py's.
_FIRST_IMPORT_WARNING = re.compile(r"^\[NeMo W [^\n]*\n(?:[ \t][^\n]*\n|\n)*", re.M)


def _refused(argv, capsys, *needles) -> str:
    code = main([str(a) for a in argv])
    err = _FIRST_IMPORT_WARNING.sub("", capsys.readouterr().err)
    assert code == 2, err
    assert err.count("\n") == 1, err  # one line
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def no_model_built(monkeypatch):
    """Fail the test if a command builds a model or reads a tensor before it refuses."""
    from porting.convert import connectors, export, megatron, table_check
    from porting.convert.safetensors_io import SafetensorsSource

    def built(*a, **k):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(connectors.PortingImporter, "nemo_setup", built)
    monkeypatch.setattr(export, "build_mcore_model", built)
    monkeypatch.setattr(megatron, "build_mcore_model", built)
    monkeypatch.setattr(SafetensorsSource, "get", built)
    return table_check


# -- 1. plan before allocating -------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,needles",
    [
        (
            {"num_hidden_layers": 100000},
            ["config.json: num_hidden_layers is 100000", "hold layers 0..1 (2)"],
        ),
        ({"vocab_size": 2**40}, ["model.safetensors: tensor", "(1099511627776, 64)"]),
        ({"intermediate_size": 2**40}, ["model.safetensors: tensor", "1099511627776"]),
    ],
    ids=["layers", "vocab", "ffn"],
)
def test_import_refuses_a_config_larger_than_its_weights_before_building(
    tiny_llama, tmp_path, capsys, no_model_built, monkeypatch, changes, needles
):
    hf = _edited_hf(tiny_llama, tmp_path / "hf", **changes)
    if "num_hidden_layers" in changes:
        # The layer count is read from the names alone: not even the meta-device HF model of a
        # 100000-layer config is built.
        def meta(*a, **k):
            raise AssertionError("the HF model of the config was built")

        monkeypatch.setattr(no_model_built, "hf_meta_shapes", meta)
    _refused(["import", hf, "--out", tmp_path / "out"], capsys, *needles)
    assert not (tmp_path / "out").exists()


def _hf_value(hf: Path, field: str):
    return json.loads((hf / "config.json").read_text())[field]


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"num_hidden_layers": 100000}, ["porting.json: hf_config's num_hidden_layers is 100000",
                                         "holds 2 layers"]),
        ({"vocab_size": 2**40}, ["hf_config.vocab_size is 1099511627776, but vocab_size is 130"]),
        ({"intermediate_size": 99}, ["linear_fc1.weight' is (2, 196, 64)", "makes it (2, 198, 64)"]),
    ],
    ids=["layers", "vocab", "ffn"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["export", "verify"])
def test_export_and_verify_refuse_a_manifest_that_lies_about_the_weights(
    tiny_llama, tiny_nemo, tmp_path, capsys, command, changes, needles
):
    ckpt = _edited_ckpt(tiny_nemo, tmp_path / "ckpt", **changes)
    argv = ["export", ckpt, "--out", tmp_path / "out"] if command == "export" else [
        "verify", tiny_llama, ckpt
    ]  # fmt: skip
    if command == "verify" and "vocab_size" not in changes:
        # verify has the HF directory the checkpoint came from: its config and the manifest
        # disagree, which is said before any weight is read
        ((field, value),) = changes.items()
        needles = ["porting.json) and", f"{field} {value} against {_hf_value(tiny_llama, field)}"]
    _refused(argv, capsys, *needles)
    assert not (tmp_path / "out").exists()


def test_an_integer_weight_is_refused_by_name(tiny_llama, tmp_path, capsys, no_model_built):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    tensors = load_file(hf / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight"
    tensors[key] = tensors[key].view(torch.int32)  # the right byte size, the wrong type
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    _refused(
        ["import", hf, "--out", tmp_path / "out", "--no-verify"],
        capsys,
        f"tensor '{key}' is stored as I32; weights must be floating point",
    )


# -- 2. inputs are never outputs -----------------------------------------------------------------


def test_import_and_export_refuse_an_output_that_is_inside_or_contains_the_input(
    tiny_llama, tiny_nemo, tmp_path, capsys
):
    hf = tmp_path / "models" / "hf"
    shutil.copytree(tiny_llama, hf)
    (tmp_path / "link").symlink_to(hf)
    before = _digest(hf)
    cases = [
        (["import", hf, "--out", hf, "--overwrite"], "is the HF directory"),
        (["import", hf, "--out", hf / "ckpt"], "lies inside the HF directory"),
        (["import", hf, "--out", hf.parent, "--overwrite"], "contains the HF directory"),
        (["import", tmp_path / "link", "--out", hf, "--overwrite"], "is the HF directory"),
        (["import", hf, "--out", tmp_path / "link", "--overwrite"], "after symlinks"),
    ]
    for argv, needle in cases:
        _refused(argv, capsys, needle, "nothing was written")
    assert _digest(hf) == before
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_nemo, ckpt)
    before = _digest(ckpt)
    _refused(["export", ckpt, "--out", ckpt, "--overwrite"], capsys, "is the checkpoint")
    _refused(["export", ckpt, "--out", ckpt / "context"], capsys, "lies inside the checkpoint")
    assert _digest(ckpt) == before


def test_prep_data_merge_and_train_refuse_an_output_over_an_input(
    tiny_llama, tiny_nemo, train_corpus, tmp_path, capsys
):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "hello"}\n')
    tok = tmp_path / "tok"
    shutil.copytree(tiny_llama, tok)
    prep = ["prep-data", "--tokenizer", tok, "--overwrite"]
    _refused(
        [*prep, "--input", corpus, "--output-prefix", corpus / "out"],
        capsys,
        "lies inside the input",
    )
    _refused(
        [*prep, "--input", corpus / "a.jsonl", "--output-prefix", tok / "x"],
        capsys,
        "the tokenizer",
    )
    data = tmp_path / "data" / "d"
    (tmp_path / "data").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copyfile(f"{train_corpus}{ext}", f"{data}{ext}")
    merge = ["prep-data", "merge", data, "--output-prefix", data, "--overwrite"]
    _refused(merge, capsys, "is the dataset")
    train = ["train", "--checkpoint", tiny_nemo, "--data", data, "--steps", "1", "--dry-run"]
    _refused([*train, "--out", tiny_nemo], capsys, "--out", "is the --checkpoint")
    _refused([*train, "--out", tmp_path / "data"], capsys, "contains the --data file")
    assert (corpus / "a.jsonl").read_text() == '{"text": "hello"}\n'  # fmt: skip


# -- 4. the tokenizer contract uses the real vocabulary (train: tests/test_train.py,
#    test_validation_catches_data_from_another_tokenizer) ------------------------------------------


def test_prep_data_bounds_ids_by_the_hf_vocabulary_not_the_padded_one(
    tiny_nemo, tmp_path, capsys, prep_in_process
):
    ckpt = _edited_ckpt(tiny_nemo, tmp_path / "ckpt", vocab_size=5)  # padded stays 256
    manifest = ckpt / "context" / "porting.json"
    manifest.write_text(manifest.read_text().replace('"vocab_size": 130', '"vocab_size": 5'))
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello world"}\n')
    argv = [
        "prep-data",
        "--input",
        src,
        "--output-prefix",
        tmp_path / "out" / "ds",
        "--tokenizer",
        ckpt,
    ]
    _refused(
        argv, capsys, f"{src}:1: key 'text': token id", "outside the model's vocabulary (5, HF"
    )
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


# -- 5. bounded memory in skip mode --------------------------------------------------------------


def test_skip_mode_lists_a_bounded_number_of_problems_and_counts_the_rest(
    tiny_llama, tmp_path, prep_in_process
):
    from data_prep.records import PROBLEMS_LISTED

    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(3000):
            f.write(f'{{"text": "good {i}"}}\n' if i % 3 == 0 else "not json\n")
        f.write('{"other": 1}\n')
    out = tmp_path / "out" / "ds"
    argv = ["prep-data", "--input", src, "--output-prefix", out, "--tokenizer", tiny_llama]
    assert main([*map(str, argv), "--on-error", "skip", "--no-progress"]) == 0
    report = json.loads(Path(f"{out}.prep-report.json").read_text())
    assert report["problems"] == {"malformed_json": 2000, "missing_key": 1}
    assert report["skipped"] == 2001
    reasons = [r["reason"] for r in report["skipped_records"]]
    assert reasons.count("malformed_json") == PROBLEMS_LISTED
    assert reasons.count("missing_key") == 1
    assert report["skipped_not_listed"] == 2001 - PROBLEMS_LISTED - 1
    assert report["skipped_records"][0] == {
        "file": str(src), "line": 2, "reason": "malformed_json",
        "detail": report["skipped_records"][0]["detail"],
    }  # fmt: skip


def test_a_run_that_keeps_no_record_fails_unless_asked(
    tiny_llama, tmp_path, capsys, prep_in_process
):
    """On the local executor; the same on Ray: tests/test_prep_ray.py, on that module's Ray."""
    src = tmp_path / "bad.jsonl"
    src.write_text("not json\n" * 50)
    out = tmp_path / "out" / "ds"
    argv = [
        "prep-data", "--input", src, "--output-prefix", out, "--tokenizer", tiny_llama,
        "--on-error", "skip", "--no-progress",
    ]  # fmt: skip
    _refused(argv, capsys, "no record kept (50 skipped: 50 malformed_json); nothing written")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
    assert main([*map(str, argv), "--allow-empty"]) == 0
    assert json.loads(Path(f"{out}.prep-report.json").read_text())["records"] == 0


# -- 7. honest numbers ---------------------------------------------------------------------------


def test_non_finite_weights_are_named_on_import_and_export(tiny_llama, tiny_nemo, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    tensors = load_file(hf / "model.safetensors")
    tensors["lm_head.weight"][3, 5] = float("nan")
    tensors["lm_head.weight"][4, 5] = float("inf")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    _refused(
        ["import", hf, "--out", tmp_path / "out", "--no-verify"],
        capsys,
        "model.safetensors: tensor 'lm_head.weight' holds 2 NaN/Inf value(s)",
    )
    _refused(["verify", hf, tiny_nemo], capsys, "'lm_head.weight' holds 2 NaN/Inf")
    assert not (tmp_path / "out").exists()


def test_non_finite_logits_fail_the_gate_and_the_json_stays_strict(capsys):
    from porting.commands.verify import print_report
    from porting.parity.harness import compare

    hf = [torch.full((1, 3, 10), float("nan"))]
    mc = [torch.full((1, 3, 10), float("nan"))]
    report = compare(hf, mc)
    assert not report.passed
    assert report.top1_agreement == 0.0  # NaN rows never "agree"
    assert (report.nonfinite_hf, report.nonfinite_megatron) == (30, 30)
    assert "NOT FINITE     30 NaN/Inf logit values from HF, 30 from Megatron" in report.summary()
    print_report(report, as_json=True)

    def bare(constant):
        raise AssertionError(f"bare {constant} in JSON output")

    data = json.loads(capsys.readouterr().out, parse_constant=bare)
    assert data["max_abs_diff"] is None and data["passed"] is False
    mixed = compare([torch.zeros(1, 2, 4)], [torch.tensor([[[0.0, 1, 2, math.inf], [0, 0, 0, 0]]])])
    assert mixed.nonfinite_megatron == 1 and not mixed.passed


def test_copied_files_follow_the_umask(tiny_llama, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    (hf / "generation_config.json").chmod(0o600)
    old = os.umask(0o022)
    try:
        assert main(["import", str(hf), "--out", str(tmp_path / "ck"), "--no-verify"]) == 0
    finally:
        os.umask(old)
    modes = {
        p.relative_to(tmp_path / "ck").as_posix(): p.stat().st_mode & 0o777
        for p in (tmp_path / "ck").rglob("*")
    }
    assert modes["context/hf_extra/generation_config.json"] == 0o644
    assert {m for m in modes.values()} <= {0o644, 0o755}, modes


# -- 3. a full disk ------------------------------------------------------------------------------


def test_a_full_disk_during_import_is_one_line_and_leaves_nothing(tiny_llama, tmp_path):
    out = tmp_path / "disk" / "ck"
    argv = [sys.executable, "-m", "porting.cli", "import", str(tiny_llama), "--out", str(out)]
    code, err, left = on_a_small_disk("300k", argv + ["--no-verify"], out)
    assert code == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"porting import: error: no space left on the device writing {out}; partial output removed"
    ), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert left == []


def test_a_full_disk_during_a_train_checkpoint_is_one_line(tiny_nemo, train_corpus, tmp_path):
    out = tmp_path / "disk" / "run"
    argv = [
        sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(tiny_nemo),
        "--data", str(train_corpus), "--out", str(out), "--steps", "4", "--save-every", "2",
        "--seq-length", "32", "--micro-batch", "2", "--global-batch", "4",
    ]  # fmt: skip
    code, err, left = on_a_small_disk("600k", argv, out)
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"porting train: error: no space left on the device writing {out}"), err[
        -3000:
    ]
    assert "no checkpoint was complete" in last, last


def test_train_refuses_a_model_this_machine_cannot_hold(
    tiny_nemo, train_corpus, tmp_path, capsys, monkeypatch
):
    from porting.convert import preflight

    monkeypatch.setattr(preflight, "available_bytes", lambda: 1000)
    argv = ["train", "--checkpoint", tiny_nemo, "--data", train_corpus, "--out", tmp_path / "run"]
    _refused(
        [*argv, "--steps", "1", "--dry-run"],
        capsys,
        "parameters need at least",
        "on this node for fp32 weights and gradients alone (1 rank(s), each 1/1 of the model)",
        "it has 1000 B free",
    )
    assert not (tmp_path / "run").exists()


def test_import_refuses_a_tensor_larger_than_free_memory(tiny_llama, tmp_path, capsys, monkeypatch):
    from porting.convert import preflight

    monkeypatch.setattr(preflight, "available_bytes", lambda: 1000)
    _refused(
        ["import", tiny_llama, "--out", tmp_path / "out"],
        capsys,
        "import needs at least 65.0 KiB at once for tensor '",
        "(130, 64) F32",
        "this machine has 1000 B free",
    )
