"""Continued pretraining through `porting train` on the CPU (fp32, gloo), tsuzumi family.

Each run is a real `porting train` process (NeMo's trainer, MegatronStrategy, Megatron's GPT dataset
over a .bin/.idx written by Megatron's IndexedDatasetBuilder).
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from porting.errors import PortingError
from porting.testing import (
    TRAIN_TEXT,
    run_in_session,
    train_losses,
)

COMMON = ["--seq-length", "32", "--micro-batch", "2", "--global-batch", "4", "--lr", "1e-2"]


def _train_argv(ckpt, data, out, *extra: str) -> list[str]:
    """`python -m porting.cli train` for ``ckpt`` on ``data`` into ``out``, plus ``extra`` flags."""
    return [
        sys.executable, "-m", "porting.cli", "train",
        "--checkpoint", str(ckpt), "--data", str(data), "--out", str(out), *extra, *COMMON,
    ]  # fmt: skip


def _run_train(ckpt, data, out, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_in_session(_train_argv(ckpt, data, out, *extra), timeout)


@pytest.fixture(scope="module")
def reference_run(tiny_nemo, train_corpus, tmp_path_factory):
    """An uninterrupted 24-step run, checkpointing every 4 steps."""
    out = tmp_path_factory.mktemp("runs") / "ref"
    r = _run_train(
        tiny_nemo, train_corpus, out, "--steps", "24", "--warmup", "2", "--save-every", "4"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_loss_falls_and_checkpoints_appear(reference_run):
    losses = train_losses(reference_run)
    assert sorted(losses) == list(range(24))
    # a repeated sentence: the tiny model must fit it well within 24 steps
    assert losses[23] < 0.6 * losses[0], losses
    last = reference_run / "checkpoints" / "last"
    assert last.is_symlink() and (last / "weights" / "metadata.json").exists()
    assert (last / "context" / "porting.json").exists()
    assert list((reference_run / "tb").glob("events.out.tfevents.*"))
    assert (reference_run / "run.json").exists()
    with open(reference_run / "csv" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {"lr", "reduced_train_loss", "tokens_per_s"} <= set(rows[0])
    assert any(float(r["tokens_per_s"]) > 0 for r in rows if r.get("tokens_per_s"))


def test_export_after_training_matches_the_trained_model(tiny_llama, reference_run, tmp_path):
    """`porting export` of the trained checkpoint passes its gate with every weight changed by
    training, and (the context a training saves being read as data) without loading NeMo or
    Lightning: a fresh interpreter, as a user's export runs."""
    from porting.convert.safetensors_io import SafetensorsSource

    code = (
        "import sys\n"
        "from porting.cli import main\n"
        f"assert main(['export', {str(reference_run / 'checkpoints' / 'last')!r}, '--out', "
        f"{str(tmp_path / 'hf')!r}]) == 0\n"
        "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in "
        "('nemo', 'lightning', 'pytorch_lightning')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parity PASS" in done.stdout and "top-1 agree    100.00%" in done.stdout, done.stdout
    assert "HEAVY []" in done.stdout, done.stdout
    before, after = SafetensorsSource(tiny_llama), SafetensorsSource(tmp_path / "hf")
    assert set(before.keys()) == set(after.keys())
    changed = [k for k in before.keys() if not torch.equal(before.get(k), after.get(k))]
    assert len(changed) == len(before.keys()), "training left some weights unchanged"


def test_megatron_bridge_s_loop_trains_as_nemo_2_s_step_for_step(
    tiny_llama, train_corpus, reference_run, tmp_path
):
    """The same model, data and flags on the other engine: `porting train --engine bridge` on the
    current stack (Megatron-Core 0.19, Megatron-Bridge's pretrain) from the same HF model imported
    as a Megatron-Bridge checkpoint. Every step's loss, gradient norm and learning rate equal this
    stack's NeMo 2 run (Megatron-Core 0.15): the two engines read the flags alike."""
    from porting.testing import run_owners

    ckpt, out = tmp_path / "bridge", tmp_path / "run"
    run_owners(["-m", "porting.cli", "import", str(tiny_llama), "--out", str(ckpt),
                "--format", "megatron-bridge", "--no-verify"])  # fmt: skip
    flags = ["--steps", "24", "--warmup", "2", "--save-every", "0", *COMMON]
    run_owners(["-m", "porting.cli", "train", "--checkpoint", str(ckpt), "--data",
                str(train_corpus), "--out", str(out), "--engine", "bridge", *flags])  # fmt: skip

    def column(run, name):
        with open(next(Path(run).rglob("metrics.csv"))) as fh:
            rows = [r for r in csv.DictReader(fh) if r.get(name) and r.get("global_step")]
        return {int(float(r["global_step"])): float(r[name]) for r in rows}

    for name, tolerance in (("reduced_train_loss", 1e-6), ("grad_norm", 1e-6), ("lr", 1e-9)):
        bridge, nemo = column(out, name), column(reference_run, name)
        assert sorted(bridge) == sorted(nemo) == list(range(24)), name
        assert max(abs(bridge[s] - nemo[s]) for s in nemo) <= tolerance, (name, bridge, nemo)


def _spec(tiny_nemo, train_corpus, **kw):
    from porting.train.checks import TrainSpec

    return TrainSpec(checkpoint=tiny_nemo, data=[str(train_corpus)], out=Path("unused"), **kw)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(tp=3, gpus_per_node=3), "--tp 3 does not divide the 4 attention heads"),
        (dict(tp=4, gpus_per_node=4), "exceeds the 2 KV groups"),
        (dict(pp=3, gpus_per_node=3), "--pp 3 does not divide the 2 layers"),
        (dict(first_stage_layers=1), "--first-stage-layers / --last-stage-layers need --pp > 1"),
        (dict(pp=2, gpus_per_node=2, first_stage_layers=2), "--first-stage-layers 2: must be"),
        (
            dict(pp=3, gpus_per_node=3, first_stage_layers=1, last_stage_layers=1),
            "the 0 layers left for the 1 other pipeline stages do not divide",
        ),
        (dict(global_batch=6, micro_batch=4), "--global-batch 6 is not divisible"),
        (dict(tp=2), "1 devices are not a multiple of TP x PP x CP = 2"),
        (dict(warmup=10, steps=10), "--warmup 10 must be below --steps 10"),
        (dict(sequence_parallel=True), "--sequence-parallel needs --tp > 1"),
    ],
)
def test_validation_errors(tiny_nemo, train_corpus, kw, needle):
    from porting.testing import checkpoint_config
    from porting.train.checks import validate

    config = checkpoint_config(tiny_nemo)
    with pytest.raises(PortingError) as err:
        validate(_spec(tiny_nemo, train_corpus, **kw), config, 130)
    assert needle in str(err.value)


def test_validation_catches_data_from_another_tokenizer(tiny_nemo, tmp_path):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from porting.testing import checkpoint_config
    from porting.train.checks import validate

    prefix = tmp_path / "big_ids"
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    b.add_document(torch.tensor([5, 300, 7]), [3])
    b.finalize(str(prefix) + ".idx")
    config = checkpoint_config(tiny_nemo)
    with pytest.raises(
        PortingError, match="token id 300, beyond the checkpoint's vocabulary of 130"
    ):
        validate(_spec(tiny_nemo, prefix), config, 130)
    # An id inside the padded vocabulary (256) but past the real one (130) lands on a padding row
    # that export drops: refused too, both sizes named.
    padded = tmp_path / "padding_ids"
    b = IndexedDatasetBuilder(str(padded) + ".bin", dtype=np.uint16)
    b.add_document(torch.tensor([5, 200, 7]), [3])
    b.finalize(str(padded) + ".idx")
    with pytest.raises(PortingError) as err:
        validate(_spec(tiny_nemo, padded), config, 130)
    assert f"{padded}.bin holds token id 200, beyond the checkpoint's vocabulary of 130 " in str(
        err.value
    )
    assert "(padded to 256 for the layout)" in str(err.value)
    with pytest.raises(PortingError, match="does not exist"):
        validate(_spec(tiny_nemo, tmp_path / "nothing"), config, 130)


def test_validation_warns_past_the_trained_context(tiny_nemo, train_corpus):
    from porting.testing import checkpoint_config
    from porting.train.checks import validate

    config = checkpoint_config(tiny_nemo)
    assert validate(_spec(tiny_nemo, train_corpus, seq_length=256), config, 130) == []
    (warning,) = validate(_spec(tiny_nemo, train_corpus, seq_length=512), config, 130)
    assert "exceeds the 256 positions" in warning


def test_cli_dry_run_and_slurm_script(tiny_nemo, train_corpus, tmp_path, cli):
    """The CLI in this process (each case is an argument check or a script written, none a
    process's behaviour): what it prints and its exit status."""

    def _porting(*args: str) -> subprocess.CompletedProcess:
        return cli(list(args))

    r = _porting(
        "train",
        "--checkpoint",
        str(tiny_nemo),
        "--data",
        "0.3",
        str(train_corpus),
        "0.7",
        str(train_corpus),
        "--out",
        str(tmp_path / "run"),
        "--dry-run",
        *COMMON,
    )
    assert r.returncode == 0 and "ok: TP 1 x PP 1" in r.stdout, r.stderr[-2000:]
    r = _porting(
        "train",
        "--checkpoint",
        str(tiny_nemo),
        "--data",
        str(train_corpus),
        "--out",
        str(tmp_path / "run"),
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--executor",
        "slurm",
        "--no-submit",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    script = tmp_path / "run" / "slurm" / "train.sbatch"
    assert "--nnodes=4 --nproc-per-node=8" in script.read_text()
    assert "#SBATCH --gpus-per-node=8\n" in script.read_text()
    assert "--executor local" in script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # nodes without GPUs: none requested, --gpus-per-node is the processes per node
    r = _porting(
        "train", "--checkpoint", str(tiny_nemo), "--data", str(train_corpus), "--out",
        str(tmp_path / "cpu"), "--nodes", "2", "--executor", "slurm", "--no-submit", "--cpu-nodes",
        "--partition", "cpu", "--time", "1:00:00",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    text = (tmp_path / "cpu" / "slurm" / "train.sbatch").read_text()
    assert "--gpus-per-node" not in text.split("srun")[0] and "--nproc-per-node=1" in text
    assert "#SBATCH --partition=cpu\n#SBATCH --time=1:00:00\n" in text
    r = _porting(
        "train",
        "--checkpoint",
        str(tiny_nemo),
        "--data",
        str(train_corpus),
        "--out",
        str(tmp_path / "x"),
        "--gpus-per-node",
        "2",
    )
    assert r.returncode == 2 and "--executor torchrun" in r.stderr


def test_falcon_trains_through_the_same_entry_and_exports(tmp_path):
    """The Falcon family's custom spec trains with the same `porting train` and exports with parity."""
    from transformers import AutoTokenizer

    from porting.api import export_hf, import_hf
    from porting.testing import make_falcon, make_indexed_dataset

    hf = make_falcon(
        tmp_path / "hf", new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=98
    )
    import_hf(hf, tmp_path / "nemo", show_progress=False)
    tok = AutoTokenizer.from_pretrained(str(hf))
    data = make_indexed_dataset(tmp_path / "data" / "corpus_text_document", tok, [TRAIN_TEXT] * 300)
    out = tmp_path / "run"
    r = _run_train(
        str(tmp_path / "nemo"),
        str(data),
        str(out),
        "--steps",
        "16",
        "--warmup",
        "2",
        "--save-every",
        "16",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    losses = train_losses(out)
    assert losses[15] < 0.6 * losses[0], losses
    report = export_hf(out / "checkpoints" / "last", tmp_path / "back")
    assert report.passed and report.top1_agreement == 1.0


def test_nemo_run_executor_launches_the_same_training(tiny_nemo, train_corpus, tmp_path):
    out = tmp_path / "nr"
    r = _run_train(
        str(tiny_nemo),
        str(train_corpus),
        str(out),
        "--steps",
        "2",
        "--executor",
        "nemo-run",
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert sorted(train_losses(out)) == [0, 1]


def test_a_metrics_row_cut_by_a_stop_is_dropped_before_the_resumed_run_appends(tmp_path):
    """A run stopped mid-append leaves metrics.csv's last row without its newline. The resumed
    run's logger (Lightning's CSV logger, continued: porting.train.recipe) cuts that row before
    appending, so a later header rewrite (a new metric) reads every row: before, the resumed
    row joined the cut one and Lightning failed on 'fields not in fieldnames: None'."""
    from porting.train.recipe import _csv_logger

    metrics = tmp_path / "csv" / "metrics.csv"
    metrics.parent.mkdir()
    metrics.write_text("global_step,reduced_train_loss\n0,5.0\n1,4.5\n2,4.")
    logger = _csv_logger(tmp_path)
    logger.log_metrics({"reduced_train_loss": 4.2}, step=2)
    logger.log_metrics({"reduced_train_loss": 4.0, "val_loss": 4.1}, step=3)  # a header rewrite
    logger.save()
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    assert all(None not in r for r in rows), rows
    assert [r["reduced_train_loss"] for r in rows] == ["5.0", "4.5", "4.2", "4.0"]
    assert rows[-1]["val_loss"] == "4.1"
