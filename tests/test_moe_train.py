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
def test_expert_parallel_2_trains_as_expert_parallel_1_and_exports(mixtral, tmp_path, cli):
    hf, ckpt, data = mixtral
    one = _train(ckpt, data, tmp_path / "ep1")
    two = _train(
        ckpt, data, tmp_path / "ep2", "--gpus-per-node", "2", "--executor", "torchrun", "--ep", "2"
    )
    assert sorted(one) == sorted(two) == list(range(STEPS))
    for step in one:
        assert abs(one[step] - two[step]) < 1e-4, (step, one[step], two[step])
    assert one[STEPS - 1] < one[0]  # it learns
    # the export in this process: the trainings are what runs as processes here
    r = cli(["export", str(tmp_path / "ep2" / "checkpoints" / "last"),
             "--out", str(tmp_path / "hf-trained")])  # fmt: skip
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


def test_a_plan_for_the_moe_checkpoint_is_run_as_planned(mixtral, tmp_path, capsys):
    """`porting plan` on the imported MoE checkpoint emits flags (with --ep/--etp and --plan)
    that `porting train` accepts as they are, and refuses once they leave the plan."""
    from porting.cli import main

    hf, ckpt, data = mixtral
    cluster = tmp_path / "two-gpus.yaml"
    cluster.write_text(
        "gpu: {name: g, peak_bf16_tflops: 100, memory_gib: 16, hbm_tbytes_s: 1}\n"
        "node: {bandwidth_gbytes_s: 100, latency_us: 3}\n"
        "site: {bandwidth_gbit_s: 100, latency_us: 5}\n"
        "sites: [{name: a, nodes: 1, gpus_per_node: 2}]\n"
    )
    emit = tmp_path / "emit"
    argv = ["plan", "--model", str(ckpt), "--cluster", str(cluster), "--global-batch", "4"]
    argv += ["--seq-length", "32", "--layout", "tp=1,pp=1,ep=2,etp=1,mb=2,recompute=none"]
    argv += ["--emit", str(emit), "--data", str(data), "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    flags = (emit / "train_flags.txt").read_text().split()
    assert flags[flags.index("--ep") + 1] == "2" and flags[flags.index("--etp") + 1] == "1"
    capsys.readouterr()
    assert main(["train", *flags, "--dry-run", "--precision", "fp32"]) == 0, capsys.readouterr().err
    changed = list(flags)
    changed[changed.index("--ep") + 1] = "1"
    assert main(["train", *changed, "--dry-run", "--precision", "fp32"]) == 2
    assert "layouts[0].layout.ep is 2, but --ep gives 1" in capsys.readouterr().err
