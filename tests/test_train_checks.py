"""Bad input to `porting train` is refused before any process is launched, naming file and field.

A run directory holding checkpoints of another model or family, a TP that does not divide the
heads, validation data from another tokenizer, a plan emitted for another model (or flags that do
not follow it), and a resume that changes TP/PP from a checkpoint whose distributed-optimizer
state reshards across DP only. Everything here runs :func:`porting.train.preflight.preflight`, the
function the launchers call before starting ranks; one test runs the CLI to show no rank starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from porting.errors import PortingError


def _spec(tiny_nemo, train_corpus, out, **kw):
    from porting.train.checks import TrainSpec

    kw = {"seq_length": 32, "micro_batch": 2, "global_batch": 4, **kw}
    return TrainSpec(checkpoint=tiny_nemo, data=[str(train_corpus)], out=out, **kw)


def _preflight(spec):
    from porting.train.preflight import preflight

    return preflight(spec)


def _fake_checkpoint(tiny_nemo, out: Path, name: str = "step=7-last") -> Path:
    """A checkpoint directory in ``out`` whose context is a copy of ``tiny_nemo``'s."""
    ckpt = out / "checkpoints" / name
    shutil.copytree(tiny_nemo / "context", ckpt / "context")
    (ckpt / "weights").mkdir()
    return ckpt


def test_a_run_directory_of_another_family_is_refused(tiny_nemo, train_corpus, tmp_path):
    ckpt = _fake_checkpoint(tiny_nemo, tmp_path / "run")
    manifest = ckpt / "context" / "porting.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(data | {"family": "falcon"}))
    with pytest.raises(PortingError) as err:
        _preflight(_spec(tiny_nemo, train_corpus, tmp_path / "run"))
    assert str(manifest) in str(err.value) and "family is 'falcon'" in str(err.value)
    assert "another model" in str(err.value)


def test_a_run_directory_of_another_model_is_refused(tiny_nemo, train_corpus, tmp_path):
    ckpt = _fake_checkpoint(tiny_nemo, tmp_path / "run")
    manifest = ckpt / "context" / "porting.json"
    data = json.loads(manifest.read_text())
    data["hf_config"]["hidden_size"] = 128
    manifest.write_text(json.dumps(data))
    with pytest.raises(PortingError) as err:
        _preflight(_spec(tiny_nemo, train_corpus, tmp_path / "run"))
    assert str(manifest) in str(err.value) and "hf_config.hidden_size is 128" in str(err.value)

    # a checkpoint without our manifest is judged by NeMo's model.yaml
    manifest.unlink()
    model_yaml = ckpt / "context" / "model.yaml"
    model_yaml.write_text("config:\n  num_layers: 2\n  num_attention_heads: 8\n")
    with pytest.raises(PortingError) as err:
        _preflight(_spec(tiny_nemo, train_corpus, tmp_path / "run"))
    assert str(model_yaml) in str(err.value)
    assert "config.num_attention_heads is 8" in str(err.value)


def test_a_tp_that_does_not_divide_the_heads_names_the_model_file(
    tiny_nemo, train_corpus, tmp_path
):
    with pytest.raises(PortingError) as err:
        _preflight(_spec(tiny_nemo, train_corpus, tmp_path / "run", tp=3, gpus_per_node=3))
    message = str(err.value)
    assert "--tp 3 does not divide the 4 attention heads" in message
    assert str(tiny_nemo / "context" / "porting.json") in message


def test_validation_data_from_another_tokenizer_is_refused(tiny_nemo, train_corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "other_tokenizer"
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    b.add_document(torch.tensor([5, 300, 7]), [3])
    b.finalize(str(prefix) + ".idx")
    spec = _spec(tiny_nemo, train_corpus, tmp_path / "run", valid_data=[str(prefix)])
    with pytest.raises(PortingError) as err:
        _preflight(spec)
    assert f"--valid-data: {prefix}.bin holds token id 300" in str(err.value)
    assert "another tokenizer" in str(err.value)
    spec.valid_data = ["0.5", str(train_corpus), "0.5", str(tmp_path / "missing")]
    with pytest.raises(PortingError, match=r"--valid-data: .*missing\.bin does not exist"):
        _preflight(spec)


def _plan(tmp_path, **model) -> Path:
    """A plan.json as `porting plan --emit` writes it, for the tiny model unless overridden."""
    shape = {"name": "tiny", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 98}
    plan = {
        "model": shape | {"vocab": 130} | model,
        "global_batch": 4,
        "seq_length": 32,
        "settings": {"distributed_optimizer": True, "overlap_grad_reduce": False,
                     "overlap_param_gather": False, "grad_reduce_in_fp32": True},
        "layouts": [{
            "layout": {"tp": 1, "cp": 1, "pp": 2, "vp": 1, "dp": 1, "micro_batch": 2,
                       "recompute": "none", "instances": 1, "sequence_parallel": False},
            "rank_order": "tp-cp-ep-pp-dp",
        }],
    }  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_a_plan_for_another_model_is_refused(tiny_nemo, train_corpus, tmp_path):
    planned = dict(pp=2, gpus_per_node=2, use_tp_pp_dp_mapping=True)
    spec = _spec(tiny_nemo, train_corpus, tmp_path / "run", plan=_plan(tmp_path), **planned)
    _preflight(spec)  # the plan for this model and these flags passes
    spec.plan = _plan(tmp_path, hidden=8192, name="llama-70b")
    with pytest.raises(PortingError) as err:
        _preflight(spec)
    assert str(spec.plan) in str(err.value) and "model.hidden is 8192" in str(err.value)
    assert "another model (llama-70b)" in str(err.value)
    spec.plan = _plan(tmp_path)
    spec.micro_batch = 1
    with pytest.raises(PortingError, match=r"layouts\[0\]\.layout\.micro_batch is 2"):
        _preflight(spec)
    spec.micro_batch, spec.use_tp_pp_dp_mapping = 2, False
    with pytest.raises(PortingError, match=r"layouts\[0\]\.rank_order"):
        _preflight(spec)
    # a plan's pipeline split must be the flags' too
    spec.use_tp_pp_dp_mapping = True
    data = json.loads(spec.plan.read_text())
    data["layouts"][0]["layout"] |= {"first_layers": 1, "middle_layers": 0, "last_layers": 1}
    spec.plan.write_text(json.dumps(data))
    with pytest.raises(PortingError, match=r"first_layers/last_layers are \(1, 1\)"):
        _preflight(spec)
    spec.first_stage_layers = spec.last_stage_layers = 1
    _preflight(spec)
    # a dense plan's EP and ETP mean nothing without experts: not compared
    data["layouts"][0]["layout"] |= {"ep": 1, "etp": 4}
    spec.plan.write_text(json.dumps(data))
    _preflight(spec)
    # a plan for experts is run with its EP (the flags' are checked before the model's)
    data["model"]["experts"] = 4
    data["layouts"][0]["layout"] |= {"ep": 2, "etp": 1}
    spec.plan.write_text(json.dumps(data))
    with pytest.raises(PortingError, match=r"layouts\[0\]\.layout\.ep is 2, but --ep gives 1"):
        _preflight(spec)


def test_the_tp_pp_dp_order_with_context_parallel_is_refused_as_megatron_would(
    tiny_nemo, train_corpus, tmp_path
):
    # Megatron's initialize_model_parallel asserts EP x ETP = TP x CP under tp-cp-ep-pp-dp with
    # PP > 1 (its expert grid exists for a dense model too): refused before anything starts
    spec = _spec(tiny_nemo, train_corpus, tmp_path / "run", pp=2, cp=2, gpus_per_node=4,
                 use_tp_pp_dp_mapping=True)  # fmt: skip
    with pytest.raises(
        PortingError, match=r"needs --ep x --etp = --tp x --cp \(1 x 1 against 1 x 2\)"
    ):
        _preflight(spec)
    spec.use_tp_pp_dp_mapping = False
    _preflight(spec)


def test_a_layout_change_from_a_dp_reshardable_checkpoint_is_refused(
    tiny_nemo, train_corpus, tmp_path
):
    from porting.train.checks import LAYOUT_FILE

    ckpt = _fake_checkpoint(tiny_nemo, tmp_path / "run")
    layout = {"tp": 2, "pp": 1, "vp": None, "cp": 1, "dp": 1, "distributed_optimizer": True,
              "optimizer_format": "dp_reshardable", "global_step": 8}  # fmt: skip
    (ckpt / "context" / LAYOUT_FILE).write_text(json.dumps(layout))
    spec = _spec(tiny_nemo, train_corpus, tmp_path / "run")
    with pytest.raises(PortingError) as err:
        _preflight(spec)
    assert str(ckpt / "context" / LAYOUT_FILE) in str(err.value)
    assert "optimizer_format is 'dp_reshardable'" in str(err.value) and "TP 2 -> 1" in str(
        err.value
    )
    # the plain optimizer's state is stored per parameter: it reshards
    spec.distributed_optimizer = False
    assert any("with a new layout (TP 2 -> 1)" in w for w in _preflight(spec).warnings)
    # and a DP change alone is what dp_reshardable allows
    spec.distributed_optimizer, spec.tp, spec.gpus_per_node = True, 2, 4
    assert any("DP 1 -> 2" in w for w in _preflight(spec).warnings)


def test_the_launcher_refuses_before_starting_a_rank(tiny_nemo, train_corpus, tmp_path):
    out = tmp_path / "run"
    plan = _plan(tmp_path, layers=80)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run(
        [sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(tiny_nemo),
         "--data", str(train_corpus), "--out", str(out), "--seq-length", "32", "--micro-batch", "2",
         "--global-batch", "4", "--pp", "2", "--use-tp-pp-dp-mapping", "--gpus-per-node", "2",
         "--executor", "torchrun", "--plan", str(plan)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{plan}: model.layers is 80" in r.stderr
    assert "torchrun" not in r.stderr.replace("--executor torchrun", "")
    assert not out.exists() and not (tmp_path / ".run.lock").exists()


@pytest.mark.parametrize("split,share", [("99,1,0", "validation"), ("0,100,0", "training")])
def test_a_split_share_left_without_documents_is_refused(
    tiny_nemo, tiny_llama, tmp_path, split, share
):
    """40 documents at 99,1,0 leave validation none (round(39.6) = 40): Megatron's builder would
    loop forever building that share's sample index; refused before launch instead."""
    from transformers import AutoTokenizer

    from porting.testing import TRAIN_TEXT, make_indexed_dataset

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    data = make_indexed_dataset(tmp_path / "small", tok, [TRAIN_TEXT] * 40)
    spec = _spec(tiny_nemo, data, tmp_path / "run", split=split)
    with pytest.raises(PortingError, match=f"holds 40 document.*leaves the {share} share none"):
        _preflight(spec)


def test_each_engine_refuses_what_it_cannot_train_before_any_work(
    cli, tiny_nemo, train_corpus, tmp_path
):
    """On the NeMo 2 stack: Megatron-Bridge's loop is not installed, and NeMo 2's trains a NeMo 2
    checkpoint only (a Megatron-Bridge one is named, with what to do)."""
    from porting.api import convert

    argv = ["train", "--data", str(train_corpus), "--out", str(tmp_path / "run")]
    done = cli([*argv, "--checkpoint", str(tiny_nemo), "--engine", "bridge"])
    assert done.returncode == 2
    assert "--engine bridge runs Megatron-Bridge's training loop, and this environment lacks " \
        "megatron-bridge" in done.stderr, done.stderr  # fmt: skip
    bridge = tmp_path / "bridge"
    convert(tiny_nemo, bridge, "megatron-bridge", verify=False)
    done = cli([*argv, "--checkpoint", str(bridge), "--dry-run"])
    assert done.returncode == 2
    assert f"--checkpoint {bridge}: a megatron-bridge checkpoint, and --engine nemo2 trains a " \
        "NeMo 2 one: train it with --engine bridge" in done.stderr, done.stderr  # fmt: skip
    assert not (tmp_path / "run").exists()
