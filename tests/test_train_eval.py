"""Validation during `porting train` (one CPU process): a held-out prefix of the same distribution,
its loss and perplexity beside the training loss (CSV, TensorBoard, the per-step log), and the
best-validation checkpoint marked.

The corpora are sentences drawn from one small grammar: the training and validation prefixes share
the distribution, not the sentences' order or combinations.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from porting.testing import child_env

SUBJECTS = ["the quick fox", "a lazy dog", "the old cat", "a young bird", "the brown horse"]
VERBS = ["jumps over", "runs past", "sleeps near", "looks at", "walks around"]
OBJECTS = ["the tall tree", "a small house", "the green field", "a quiet river", "the red barn"]
COMMON = ["--seq-length", "32", "--micro-batch", "2", "--global-batch", "4", "--lr", "1e-2"]


def _sentences(seed: int, docs: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(
            f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
            for _ in range(3)
        )
        for _ in range(docs)
    ]


@pytest.fixture(scope="module")
def corpora(tiny_llama, tmp_path_factory):
    from transformers import AutoTokenizer

    from porting.testing import make_indexed_dataset

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    root = tmp_path_factory.mktemp("grammar")
    train = make_indexed_dataset(root / "train_text_document", tok, _sentences(0, 300))
    valid = make_indexed_dataset(root / "valid_text_document", tok, _sentences(1, 40))
    return train, valid


def _rows(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.rglob("metrics.csv")):
        with open(f) as fh:
            rows += list(csv.DictReader(fh))
    return rows


@pytest.fixture(scope="module")
def evaluated_run(tiny_nemo, corpora, tmp_path_factory):
    """24 steps, validation on the held-out prefix every 8 steps (3 batches), saves every 8."""
    train, valid = corpora
    out = tmp_path_factory.mktemp("eval") / "run"
    argv = [
        sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(tiny_nemo),
        "--data", str(train), "--valid-data", str(valid), "--out", str(out),
        "--steps", "24", "--warmup", "2", "--save-every", "8", "--eval-every", "8",
        "--eval-iters", "3", *COMMON,
    ]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return out, r.stdout + r.stderr


def test_validation_loss_falls_on_held_out_text(evaluated_run):
    out, _ = evaluated_run
    vals = {
        int(float(r["step"])): (float(r["val_loss"]), float(r["val_ppl"]))
        for r in _rows(out)
        if r.get("val_loss")
    }
    # logged at the step counter of the batch each validation follows
    assert sorted(vals) == [7, 15, 23], vals
    losses = [vals[s][0] for s in sorted(vals)]
    assert losses[0] > losses[1] > losses[2], losses
    # a 256-token vocabulary starts near ln(256) = 5.5; the grammar is learnt well below it
    assert losses[-1] < 0.6 * 5.5, losses
    for loss, ppl in vals.values():
        assert ppl == pytest.approx(math.exp(loss), rel=1e-5)


def test_validation_is_logged_beside_the_training_loss(evaluated_run):
    out, output = evaluated_run
    rows = _rows(out)
    assert {"val_loss", "val_ppl", "reduced_train_loss"} <= set(rows[0])
    lines = [line for line in output.splitlines() if "val_loss" in line]
    assert len(lines) == 3 and all(" loss " in line and "val_ppl" in line for line in lines), lines
    events = b"".join(p.read_bytes() for p in (out / "tb").glob("events.out.tfevents.*"))
    assert b"val_loss" in events and b"val_ppl" in events and b"reduced_train_loss" in events


def test_best_validation_checkpoint_is_marked(evaluated_run):
    out, _ = evaluated_run
    ckpts = out / "checkpoints"
    state = json.loads((ckpts / "best.json").read_text())
    assert [v["global_step"] for v in state["validations"]] == [8, 16, 24]
    assert all(v["checkpoint"] for v in state["validations"])
    best = min(state["validations"], key=lambda v: v["val_loss"])
    assert state["best"] == best
    link = ckpts / "best"
    assert link.is_symlink() and os.readlink(link) == best["checkpoint"]
    assert (link / "weights" / "metadata.json").exists()
    assert (link / "context" / "porting.json").exists()


def test_split_of_data_validates_without_a_valid_prefix(tiny_nemo, corpora, tmp_path):
    """Without --valid-data, --split carves the validation set out of --data."""
    from porting.train.checks import TrainSpec
    from porting.train.recipe import recipe

    train, _ = corpora
    spec = TrainSpec(
        checkpoint=tiny_nemo, data=[str(train)], out=tmp_path / "r", split="90,10,0",
        seq_length=32, micro_batch=2, global_batch=4, steps=8, eval_every=4, eval_iters=3,
    )  # fmt: skip
    r = recipe(spec)
    assert r.data.build_kwargs["split"] == "90,10,0" and "blend" in r.data.build_kwargs
    assert r.trainer.val_check_interval == 4 and r.trainer.limit_val_batches == 3
    spec.valid_data = [str(train)]
    r = recipe(spec)
    assert "blend_per_split" in r.data.build_kwargs and "split" not in r.data.build_kwargs


def _fake_trainer(step: int, val_loss: float | None = None):
    import torch

    metrics = {} if val_loss is None else {"val_loss": torch.tensor(val_loss)}
    return SimpleNamespace(
        global_step=step, global_rank=0, sanity_checking=False, callback_metrics=metrics
    )


def test_best_link_follows_the_lowest_validated_checkpoint(tiny_nemo, tmp_path, monkeypatch):
    """Validation after the save of the same step; a rise keeps the earlier best; a checkpoint never
    validated is never best; the history survives a restart (a new callback object)."""
    from nemo.lightning.pytorch.callbacks import ModelCheckpoint

    from porting.train.recipe import SelfDescribingCheckpoint

    # NeMo's own on_validation_end saves only for a monitored metric; nothing to save here
    monkeypatch.setattr(ModelCheckpoint, "on_validation_end", lambda *a: None, raising=False)

    ckpts = tmp_path / "checkpoints"

    def callback():
        return SelfDescribingCheckpoint(source=tiny_nemo, dirpath=str(ckpts), filename="{step}")

    def saved(cb, step: int) -> None:
        name = f"step={step - 1}"
        (ckpts / name).mkdir(parents=True)
        cb._saved[step] = name
        cb._mark_best(_fake_trainer(step))

    def validated(cb, step: int, loss: float) -> None:
        cb.on_validation_end(_fake_trainer(step, loss), None)

    cb = callback()
    saved(cb, 4)
    validated(cb, 4, 3.0)
    assert os.readlink(ckpts / "best") == "step=3"
    saved(cb, 8)
    validated(cb, 8, 3.5)  # worse: best stays
    assert os.readlink(ckpts / "best") == "step=3"
    validated(cb, 10, 1.0)  # no checkpoint at step 10: cannot be best
    assert os.readlink(ckpts / "best") == "step=3"
    cb = callback()  # a resumed run reads the history back
    saved(cb, 12)
    validated(cb, 12, 2.0)
    assert os.readlink(ckpts / "best") == "step=11"
    state = json.loads((ckpts / "best.json").read_text())
    assert [v["global_step"] for v in state["validations"]] == [4, 8, 10, 12]
    assert state["best"]["checkpoint"] == "step=11"
