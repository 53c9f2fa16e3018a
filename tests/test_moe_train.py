"""`porting train` on the MoE family: expert parallel 1 (one process) and 2 (two gloo processes
under torchrun, the experts split between them) give the same losses step by step, and the trained
checkpoint exports back to HF through the parity gate.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from porting import proof
from porting.api import import_hf
from porting.testing import TRAIN_TEXT, child_env, make_indexed_dataset, train_losses

STEPS = 6


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("moe-train")
    hf = proof.make_hf(
        root / "hf",
        "MixtralForCausalLM",
        vocab_size=130,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    import_hf(hf, root / "nemo", verify=False, show_progress=False)
    tok = AutoTokenizer.from_pretrained(str(hf))
    data = make_indexed_dataset(root / "data" / "corpus", tok, [TRAIN_TEXT] * 300)
    return hf, root / "nemo", data


def _train(ckpt, data, out, *extra):
    argv = [
        sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(ckpt),
        "--data", str(data), "--out", str(out), "--steps", str(STEPS), "--save-every", "3",
        "--seq-length", "32", "--micro-batch", "2", "--global-batch", "4", "--lr", "1e-2",
        "--precision", "fp32", *extra,
    ]  # fmt: skip
    r = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return train_losses(out)


@pytest.mark.slow
def test_expert_parallel_2_trains_as_expert_parallel_1_and_exports(mixtral, tmp_path):
    hf, ckpt, data = mixtral
    one = _train(ckpt, data, tmp_path / "ep1")
    two = _train(
        ckpt, data, tmp_path / "ep2", "--gpus-per-node", "2", "--executor", "torchrun", "--ep", "2"
    )
    assert sorted(one) == sorted(two) == list(range(STEPS))
    for step in one:
        assert abs(one[step] - two[step]) < 1e-4, (step, one[step], two[step])
    assert one[STEPS - 1] < one[0]  # it learns
    r = subprocess.run(
        [sys.executable, "-m", "porting.cli", "export", str(tmp_path / "ep2" / "checkpoints" / "last"),
         "--out", str(tmp_path / "hf-trained")],
        env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "parity PASS" in r.stdout


def test_expert_parallel_is_checked_before_launch(mixtral, tmp_path, capsys):
    from porting.cli import main

    hf, ckpt, data = mixtral
    base = ["train", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(tmp_path / "r"),
            "--seq-length", "32", "--micro-batch", "2", "--global-batch", "4", "--dry-run"]  # fmt: skip
    assert main([*base, "--ep", "3"]) == 2
    assert "--ep 3 does not divide the model's 4 experts" in capsys.readouterr().err
    assert main([*base, "--ep", "2"]) == 2  # one process: data parallel 1
    assert "--ep 2 x --etp 1 does not divide tensor x context x data parallel (1 x 1 x 1)" in (
        capsys.readouterr().err
    )
    # the MoE layers' own tensor parallelism tiles the same ranks
    assert main([*base, "--etp", "2"]) == 2
    assert "--ep 1 x --etp 2 does not divide tensor x context x data parallel (1 x 1 x 1)" in (
        capsys.readouterr().err
    )
    assert main([*base, "--etp", "0"]) == 2
    assert "--etp 0 must be at least 1" in capsys.readouterr().err
