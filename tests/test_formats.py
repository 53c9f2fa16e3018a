"""The three checkpoint layouts (porting.convert.layouts): found from the directory, converted
between exactly, read when trained elsewhere, and refused when their metadata is hostile.

What the owners' own loaders make of our checkpoints is tests/test_owners.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from porting import proof
from porting.api import convert, export_hf, import_hf
from porting.commands.demo import compare_hf_dirs
from porting.convert.checkpoint import locate
from porting.convert.foreign import reading
from porting.convert.layouts import SavedEnum, load_common, read_common
from porting.errors import PortingError


@pytest.fixture(scope="module")
def layouts(tiny_llama, tiny_nemo, tmp_path_factory):
    """``{format: checkpoint}`` of ``tiny_llama`` in all three layouts (each import gated)."""
    root = tmp_path_factory.mktemp("layouts")
    out = {"nemo2": tiny_nemo}
    for fmt in ("megatron-lm", "megatron-bridge"):
        out[fmt] = root / fmt
        import_hf(tiny_llama, out[fmt], fmt=fmt, show_progress=False)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _foreign(layouts, fmt: str, tmp_path: Path) -> Path:
    """A copy of our ``fmt`` checkpoint without our ``porting/`` directory: trained elsewhere."""
    ckpt = _copy(layouts[fmt], tmp_path / f"foreign-{fmt}")
    shutil.rmtree(ckpt / "porting")
    return ckpt


def _exact(a: Path, b: Path) -> None:
    rt = compare_hf_dirs(a, b)
    assert rt.same_keys and rt.equal_tensors == rt.tensors > 0, rt


def test_tsuzumi_every_layout_round_trips_exactly(tiny_llama, tmp_path):
    proof.prove_formats(tiny_llama, tmp_path)


def test_each_layout_is_found_and_a_wrong_format_is_named(layouts):
    for fmt, ckpt in layouts.items():
        loc = locate(ckpt)
        assert loc.format == fmt
        assert loc.prefix == ("module." if fmt == "nemo2" else "")
        assert (loc.weights / ".metadata").is_file()
    # an iteration directory is a checkpoint too, with its root for our files
    it = locate(layouts["megatron-lm"] / "iter_0000000")
    assert it.root == layouts["megatron-lm"] and it.iteration == 0
    with pytest.raises(PortingError, match="a megatron-lm checkpoint, not nemo2"):
        locate(layouts["megatron-lm"], "nemo2")
    with pytest.raises(PortingError, match="a megatron-bridge checkpoint, not megatron-lm"):
        locate(layouts["megatron-bridge"], "megatron-lm")


def test_the_cli_names_a_wrong_format_and_writes_nothing(layouts, tmp_path):
    out = tmp_path / "hf"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "porting.cli",
            "export",
            str(layouts["megatron-lm"]),
            "--format",
            "nemo2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr  # bad input (porting.cli)
    assert "a megatron-lm checkpoint, not nemo2" in run.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "tracker,needle",
    [("../../etc", "not an iteration number"), ("7", "iter_0000007: the iteration")],
)
def test_a_bad_tracker_is_refused(layouts, tmp_path, tracker, needle):
    ckpt = _copy(layouts["megatron-lm"], tmp_path / "ck")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(tracker)
    with pytest.raises(PortingError, match=needle):
        locate(ckpt)


def test_our_megatron_lm_arguments_describe_the_model(layouts, tiny_llama):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    for fmt in ("megatron-lm", "megatron-bridge"):
        common = read_common(locate(layouts[fmt]))
        args = common["args"]
        assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
        assert isinstance(args, argparse.Namespace)
        assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (
            cfg["num_hidden_layers"],
            cfg["hidden_size"],
            cfg["intermediate_size"],
        )
        assert (args.num_attention_heads, args.num_query_groups) == (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
        )
        assert args.swiglu and args.normalization == "RMSNorm" and args.rotary_base == 50000
        assert args.untie_embeddings_and_output_weights and args.padded_vocab_size == 256


def test_conversion_between_layouts_is_exact(layouts, tiny_llama, tmp_path):
    bridge = tmp_path / "bridge"
    convert(layouts["nemo2"], bridge, "megatron-bridge")
    assert locate(bridge).format == "megatron-bridge"
    back = tmp_path / "nemo2"
    convert(bridge, back, "nemo2")
    export_hf(back, tmp_path / "hf", verify=False)
    _exact(tiny_llama, tmp_path / "hf")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("fmt", ["megatron-lm", "megatron-bridge"])
def test_a_checkpoint_trained_elsewhere_exports_with_the_hf_config(
    layouts, tiny_llama, tmp_path, fmt
):
    ckpt = _foreign(layouts, fmt, tmp_path)
    with pytest.raises(PortingError, match="--hf-config"):
        export_hf(ckpt, tmp_path / "no")
    with reading(ckpt, hf_config=tiny_llama / "config.json"):
        export_hf(ckpt, tmp_path / "hf")  # gated
    _exact(tiny_llama, tmp_path / "hf")
    # the tokenizer, and only the tokenizer, came from the config's directory
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if "token" in p.name)
    assert not (tmp_path / "hf" / "generation_config.json").exists()


def test_saved_arguments_that_disagree_with_the_hf_config_are_located(
    layouts, tiny_llama, tmp_path
):
    ckpt = _foreign(layouts, "megatron-lm", tmp_path)
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text()) | {"num_hidden_layers": 3}
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PortingError) as err:
        with reading(ckpt, hf_config=cfg_dir):
            pass
    assert "common state (args): num_layers is 2" in str(err.value)
    assert f"{cfg_dir / 'config.json'}" in str(err.value) and "makes it 3" in str(err.value)


def test_hf_config_is_refused_for_our_own_checkpoint(layouts, tiny_llama):
    with pytest.raises(PortingError, match="carries its own porting.json"):
        with reading(layouts["megatron-lm"], hf_config=tiny_llama):
            pass


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch HACKED",))


def test_a_common_pt_naming_any_other_global_is_refused_unrun(layouts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _copy(layouts["megatron-lm"], tmp_path / "ck")
    torch.save({"args": _RunsCode(), "iteration": 0}, ckpt / "iter_0000000" / "common.pt")
    with pytest.raises(PortingError, match=r"common.pt: refused .*(posix|os)\.system"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "HACKED").exists() and not (tmp_path / "hf").exists()


def test_saved_enums_are_read_as_data():
    import io

    from megatron.core.transformer.enums import AttnBackend

    buf = io.BytesIO()
    torch.save(
        {
            "args": argparse.Namespace(
                attention_backend=AttnBackend.auto, params_dtype=torch.bfloat16
            )
        },
        buf,
    )
    args = load_common(buf.getvalue(), "here")["args"]
    # torch rebuilds an enum whose class this process already imported; otherwise our stand-in
    # holds its name and value. Either way no module is imported and nothing else runs.
    assert args.attention_backend.value == AttnBackend.auto.value
    assert type(args.attention_backend) in (AttnBackend, SavedEnum)
    assert args.params_dtype is torch.bfloat16


def test_a_hostile_dot_metadata_is_refused_unrun(layouts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _copy(layouts["megatron-lm"], tmp_path / "ck")
    (ckpt / "iter_0000000" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(
        PortingError, match=r"\.metadata: unreadable .*(posix|os)\.system is not allowed"
    ):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "HACKED").exists()


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            lambda m: m["activation_func"].update(_target_="os.system"),
            "<root>.model.activation_func._target_ 'os.system' is not allowed",
        ),
        (lambda m: m.update(_target_="mypkg.Provider"), "is not a Megatron-Bridge provider"),
        # a family's own provider is allowed for that family's checkpoints only
        (
            lambda m: m.update(_target_="models.falcon_bridge.FalconModelProvider"),
            "is not a Megatron-Bridge provider or family llama's",
        ),
    ],
)
def test_a_run_config_outside_the_allow_list_is_refused(layouts, tmp_path, edit, needle):
    import yaml

    ckpt = _copy(layouts["megatron-bridge"], tmp_path / "ck")
    path = ckpt / "iter_0000000" / "run_config.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data["model"])
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PortingError, match=r"run_config\.yaml: .*" + re.escape(needle)):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_run_config_describes_the_model(layouts, tiny_llama):
    import yaml

    cfg = json.loads((tiny_llama / "config.json").read_text())
    path = layouts["megatron-bridge"] / "iter_0000000" / "run_config.yaml"
    model = yaml.safe_load(path.read_text())["model"]
    assert model["_target_"] == "megatron.bridge.models.gpt_provider.GPTModelProvider"
    assert (model["num_layers"], model["hidden_size"], model["num_query_groups"]) == (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_key_value_heads"],
    )
    assert model["vocab_size"] == 256 and model["should_pad_vocab"] is False
    assert model["activation_func"] == {"_target_": "torch.nn.functional.silu", "_call_": False}
    assert model["transformer_layer_spec"]["_target_"] == (
        "megatron.bridge.models.gpt_provider.default_layer_spec"
    )
    assert model["rotary_base"] == 50000 and model["share_embeddings_and_output_weights"] is False


def test_a_gate_in_its_own_process_reads_an_adopted_checkpoint(layouts, tiny_llama, tmp_path):
    """The device gate and the OOM fallback run verify in a child: it gets the --hf-config."""
    from porting.parity.harness import (
        DEFAULT_ATOL,
        DEFAULT_MIN_TOP1,
        DEFAULT_RTOL,
        _verify_in_child,
    )

    ckpt = _foreign(layouts, "megatron-lm", tmp_path)
    given = dict(
        atol=DEFAULT_ATOL,
        rtol=DEFAULT_RTOL,
        min_top1=DEFAULT_MIN_TOP1,
        whole_model=False,
        allow_pickle=False,
        scratch_dir=None,
    )
    with reading(ckpt, hf_config=tiny_llama):
        report = _verify_in_child(tiny_llama, ckpt, "cpu", given)
    assert report.passed and report.max_abs_diff < 1e-5


def test_our_checkpoint_whose_saved_arguments_were_edited_is_refused(layouts, tmp_path):
    """Megatron-LM would build its model from the args; they must still describe the weights."""
    ckpt = _copy(layouts["megatron-lm"], tmp_path / "ck")
    common = read_common(locate(ckpt))
    common["args"].num_layers = 3
    torch.save(common, ckpt / "iter_0000000" / "common.pt")
    with pytest.raises(PortingError) as err:
        export_hf(ckpt, tmp_path / "hf")
    assert "common state (args): num_layers is 3, but" in str(err.value)
    assert "porting/porting.json makes it 2" in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_a_failed_conversion_leaves_nothing(layouts, tmp_path):
    """A gate that fails (zero tolerance: fp32 sums differ in the last bits) stops the conversion:
    neither the output nor the private HF staging directory is left."""
    from porting.api import ParityError

    out = tmp_path / "out"
    with pytest.raises(ParityError):
        convert(layouts["nemo2"], out, "megatron-lm", atol=0.0, rtol=0.0)
    assert list(tmp_path.iterdir()) == []


def test_convert_prints_one_json_list(layouts, tmp_path, cli):
    """What `convert --json` prints on stdout: one JSON list, a report per step (in this process:
    what a fresh process adds on its start-up is tests/test_output.py's)."""
    out = tmp_path / "mlm"
    run = cli(
        ["convert", str(layouts["nemo2"]), "--to", "megatron-lm", "--out", str(out), "--json"]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    reports = json.loads(run.stdout)
    assert [r["passed"] for r in reports] == [True, True]
    assert locate(out).format == "megatron-lm"


def test_convert_refuses_an_existing_output_and_keeps_it(layouts, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine").write_text("keep")
    with pytest.raises(PortingError, match="exists; pass --overwrite"):
        convert(layouts["nemo2"], out, "megatron-lm")
    assert (out / "mine").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_sigterm_between_the_steps_of_a_conversion_leaves_nothing(layouts, tmp_path):
    """Stopped once the HF staging copy is complete (the import step under way): exit non-zero,
    no output, no staging directory, no partial checkpoint."""
    import signal
    import time

    from porting.testing import child_env

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "porting.cli",
            "convert",
            str(layouts["nemo2"]),
            "--to",
            "megatron-lm",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=child_env(),
    )
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            if any(tmp_path.glob(".out.hf-*/hf/config.json")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the conversion ended before it could be stopped"
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0, err[-2000:]
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
