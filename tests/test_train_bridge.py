"""`porting train --engine bridge`: continued pretraining on Megatron-Bridge's own loop (the
current stack's engine; CPU, fp32, gloo), from a `porting import --format megatron-bridge`
checkpoint of the tsuzumi family over a .bin/.idx written by Megatron's IndexedDatasetBuilder.

Each run is a real `porting train` process. On the current stack no NeMo is installed, and the
engine is Bridge's by default.
"""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import pytest
import torch

from porting.errors import PortingError
from porting.testing import TINY_TRAIN, porting_train, train_losses

COMMON = list(TINY_TRAIN)
RUN = ["--steps", "8", "--warmup", "2", "--save-every", "4"]


@pytest.fixture(scope="module")
def bridge_ckpt(tiny_llama, tmp_path_factory):
    """``tiny_llama`` imported as a Megatron-Bridge checkpoint (parity-gated)."""
    from porting.api import import_hf

    out = tmp_path_factory.mktemp("bridge") / "ckpt"
    import_hf(tiny_llama, out, show_progress=False, fmt="megatron-bridge")
    return out


@pytest.fixture(scope="module")
def reference(bridge_ckpt, train_corpus, tmp_path_factory):
    """An uninterrupted 8-step run on one process, checkpointing every 4 steps."""
    out = tmp_path_factory.mktemp("runs") / "ref"
    done = porting_train(bridge_ckpt, train_corpus, out, *RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


def test_the_current_stack_trains_on_bridge_by_default_and_says_one_line_a_step(reference):
    out, done = reference
    # no --engine given: NeMo is not installed here, so Bridge's loop ran
    assert (
        not any(m == "nemo" for m in sys.modules)
        and __import__("importlib").util.find_spec("nemo") is None
    )
    lines = done.stderr.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps[:8]] == [f"{i}/8" for i in range(1, 9)], lines
    assert "val_loss" in steps[-1], lines
    # Bridge's narration (its set-up, its per-iteration lines, its warnings) is in the log files,
    # whole; the terminal has our lines only
    foreign = [line for line in lines if not line.startswith("step ")]
    assert foreign == [], foreign
    assert done.stdout.strip() == (
        f"done: checkpoints in {out / 'checkpoints'} (newest: iter_0000008)"
    )
    assert "iteration        8/       8" in (out / "logs" / "rank0.log").read_text()


def test_loss_falls_and_the_run_directory_is_a_bridge_checkpoint_root(reference):
    out, _ = reference
    losses = train_losses(out)
    assert sorted(losses) == list(range(8))
    assert losses[7] < 0.75 * losses[0], losses
    ckpts = out / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "8"
    for it in ("iter_0000004", "iter_0000008"):
        assert (ckpts / it / ".metadata").is_file() and (ckpts / it / "run_config.yaml").is_file()
    assert (ckpts / "porting" / "porting.json").is_file()
    assert list((out / "tb").glob("events.out.tfevents.*"))
    with open(out / "csv" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {"lr", "reduced_train_loss", "tokens_per_s", "grad_norm"} <= set(rows[0])
    validated = [r for r in rows if r["val_loss"]]
    assert len(validated) == 1 and validated[0]["global_step"] == "7"
    import json

    run = json.loads((out / "run.json").read_text())
    assert run["engine"] == "bridge"
    assert run["built"] | {"optimizer": None} == {
        "tp": 1, "pp": 1, "cp": 1, "dp": 1, "ep": 1, "optimizer": None,
        "inner_optimizer": "AdamW", "layers_this_rank": 2,
    }  # fmt: skip
    assert run["built"]["optimizer"] == "DistributedOptimizer"


def test_export_of_the_trained_root_passes_its_gate_with_every_weight_changed(
    tiny_llama, reference, tmp_path
):
    from porting.api import export_hf
    from porting.convert.safetensors_io import SafetensorsSource

    out, _ = reference
    report = export_hf(out / "checkpoints", tmp_path / "hf")
    assert report.passed and report.max_abs_diff < 1e-4
    before, after = SafetensorsSource(tiny_llama), SafetensorsSource(tmp_path / "hf")
    assert set(before.keys()) == set(after.keys())
    changed = [k for k in before.keys() if not torch.equal(before.get(k), after.get(k))]
    assert len(changed) == len(before.keys()), "training left some weights unchanged"


def test_a_run_stopped_after_a_save_resumes_to_the_uninterrupted_losses(
    bridge_ckpt, train_corpus, reference, tmp_path
):
    """A stop between the step-4 and step-8 saves, as :func:`stop.settle_checkpoints` leaves it
    (the unfinished iteration gone, the trackers on iteration 4); re-running the same command
    resumes with the optimizer, schedule and data position of step 4: every later loss equals the
    uninterrupted run's exactly."""
    from porting.train.stop import settle_checkpoints

    ref, _ = reference
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "csv")
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    (out / "checkpoints" / "iter_0000008" / ".metadata").unlink()  # a save cut short
    kept = settle_checkpoints(out)
    assert kept == (
        f"last complete checkpoint {out / 'checkpoints'} -> iter_0000004 "
        "(removed unfinished iter_0000008)"
    )
    done = porting_train(bridge_ckpt, train_corpus, out, *RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, uninterrupted = train_losses(out), train_losses(ref)
    assert sorted(resumed) == [4, 5, 6, 7]
    assert {s: uninterrupted[s] for s in resumed} == resumed


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_two_ranks_split_by_tensor_or_pipeline_give_the_one_rank_losses(
    bridge_ckpt, train_corpus, reference, tmp_path, layout
):
    """Two gloo processes under torchrun, the model split by tensor (TP=2) or by layers (PP=2:
    the losses exist on the last stage only, whose rank writes them)."""
    out = tmp_path / layout
    done = porting_train(
        bridge_ckpt, train_corpus, out, *RUN, f"--{layout}", "2", "--gpus-per-node", "2",
        "--executor", "torchrun",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if not line.startswith("step ")] == []
    split, whole = train_losses(out), train_losses(reference[0])
    assert sorted(split) == list(range(8))
    assert max(abs(split[s] - whole[s]) for s in whole) < 1e-4, (whole, split)
    import json

    built = json.loads((out / "run.json").read_text())["built"]
    assert built[layout] == 2 and built["layers_this_rank"] == (2 if layout == "tp" else 1)


def _spec(ckpt, data, out, **kw):
    from porting.train.checks import TrainSpec

    kw = {"seq_length": 32} | kw
    return TrainSpec(checkpoint=Path(ckpt), data=[str(data)], out=Path(out), **kw)


def test_a_layout_change_from_a_dp_reshardable_save_is_refused_naming_its_run_config(
    bridge_ckpt, train_corpus, reference
):
    from porting.train.preflight import preflight_bridge

    out, _ = reference
    with pytest.raises(PortingError) as err:
        preflight_bridge(_spec(bridge_ckpt, train_corpus, out, tp=2, gpus_per_node=2))
    assert str(err.value).startswith(
        f"{out / 'checkpoints' / 'iter_0000008' / 'run_config.yaml'}: "
        "checkpoint.dist_ckpt_optim_fully_reshardable is false (saved at TP=1)"
    )
    # the plain optimizer reshards per parameter: a warning, not a refusal
    pre = preflight_bridge(
        _spec(bridge_ckpt, train_corpus, out, tp=2, gpus_per_node=2, distributed_optimizer=False)
    )
    assert pre.warnings == ["resuming iter_0000008 with a new layout (TP 1 -> 2); Megatron "
                            "reshards on load"]  # fmt: skip


def test_a_run_directory_of_another_model_is_refused(bridge_ckpt, train_corpus, tmp_path):
    import json

    from porting.train.preflight import preflight_bridge

    meta = tmp_path / "run" / "checkpoints" / "porting"
    shutil.copytree(bridge_ckpt / "porting", meta)
    manifest = json.loads((meta / "porting.json").read_text())
    manifest["hf_config"]["hidden_size"] = 128
    (meta / "porting.json").write_text(json.dumps(manifest))
    with pytest.raises(PortingError, match="hf_config.hidden_size is 128, but --checkpoint"):
        preflight_bridge(_spec(bridge_ckpt, train_corpus, tmp_path / "run"))


def test_an_iteration_or_a_nemo2_checkpoint_is_refused_with_what_to_give(
    bridge_ckpt, train_corpus, tmp_path
):
    from porting.train.preflight import preflight_bridge

    it = bridge_ckpt / "iter_0000000"
    with pytest.raises(PortingError, match=r"give the checkpoint's root \(.*\), not one of its"):
        preflight_bridge(_spec(it, train_corpus, tmp_path / "run"))
    nemo2 = tmp_path / "nemo2"
    (nemo2 / "context").mkdir(parents=True)
    (nemo2 / "weights").mkdir()
    shutil.copy(bridge_ckpt / "porting" / "porting.json", nemo2 / "context" / "porting.json")
    with pytest.raises(PortingError) as err:
        preflight_bridge(_spec(nemo2, train_corpus, tmp_path / "run"))
    assert f"porting convert {nemo2} --to megatron-bridge --out DIR" in str(err.value)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--engine", "nemo2"], "--engine nemo2 runs NeMo 2's training loop, and this environment"),
        (["--executor", "nemo-run"], "--executor nemo-run comes with NeMo 2"),
    ],
)
def test_what_the_current_stack_cannot_run_is_refused_before_any_work(
    cli, bridge_ckpt, train_corpus, tmp_path, extra, needle
):
    done = cli(["train", "--checkpoint", str(bridge_ckpt), "--data", str(train_corpus),
                "--out", str(tmp_path / "run"), *extra])  # fmt: skip
    assert done.returncode == 2 and needle in done.stderr, (done.stderr, done.logged)
    assert not (tmp_path / "run").exists()


def test_a_dry_run_checks_with_the_bridge_preflight(cli, bridge_ckpt, train_corpus, tmp_path):
    done = cli(["train", "--checkpoint", str(bridge_ckpt), "--data", str(train_corpus),
                "--out", str(tmp_path / "run"), "--tp", "3", "--gpus-per-node", "3",
                "--dry-run"])  # fmt: skip
    assert done.returncode == 2 and "--tp 3 does not divide the 4 attention heads" in done.stderr
    ok = cli(["train", "--checkpoint", str(bridge_ckpt), "--data", str(train_corpus),
              "--out", str(tmp_path / "run"), "--dry-run", *COMMON])  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.startswith("ok: TP 1 x PP 1 x CP 1 x DP 1"), ok.stderr


def test_a_stopped_two_rank_run_says_what_it_kept_and_leaves_no_process(
    bridge_ckpt, train_corpus, tmp_path
):
    """SIGTERM to the whole group (a scheduler's stop) once a save is complete, under torchrun:
    exit 143, one line naming the iteration a resume starts from, no traceback, no iteration past
    the tracker, no process of the run left."""
    import signal

    from porting.testing import child_env, processes_mentioning, signal_at_first_checkpoint

    out = tmp_path / "run"
    argv = [
        sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(bridge_ckpt),
        "--data", str(train_corpus), "--out", str(out), "--steps", "400", "--save-every", "2",
        "--gpus-per-node", "2", "--executor", "torchrun", *COMMON,
    ]  # fmt: skip
    (tmp_path / "tmp").mkdir()
    done = signal_at_first_checkpoint(
        argv, out, signal.SIGTERM, 300, env=child_env(TMPDIR=str(tmp_path / "tmp"))
    )
    assert done.returncode == 143, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("porting train:")]
    ckpts = out / "checkpoints"
    kept = ckpts / f"iter_{int((ckpts / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    assert said == [
        f"porting train: stopped by SIGTERM; last complete checkpoint {ckpts} -> {kept.name}"
    ] or (
        len(said) == 1
        and said[0].startswith(f"porting train: stopped by SIGTERM; last complete checkpoint "
                               f"{ckpts} -> {kept.name} (removed unfinished ")
    ), done.stderr[-3000:]  # fmt: skip
    assert (kept / "run_config.yaml").is_file()
    assert [it.name for it in sorted(ckpts.glob("iter_*"))][-1] == kept.name
    assert not processes_mentioning(str(out), grace=5)
    assert not list((tmp_path / "tmp").glob("torchelastic_*"))


def test_a_checkpoint_directory_named_nemo_does_not_pass_for_nemo(tmp_path, monkeypatch):
    """`python -m porting.cli` puts the working directory first on the path, and a directory
    named ``nemo`` there (a user's NeMo 2 checkpoint) is a namespace package to ``find_spec``: the
    engine is still the one this environment has."""
    import importlib

    from porting.commands.train import _engine

    (tmp_path / "nemo" / "context").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert importlib.util.find_spec("nemo") is not None  # what fooled the engine's choice
    assert _engine(None) == "bridge"
