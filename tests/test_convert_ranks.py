"""One conversion over two processes (`--executor torchrun`, gloo on the CPU).

An import's ranks each write their share of the tensors into the one torch_dist checkpoint
(Megatron's fully-parallel save), an export's their share into the planned safetensors shards,
and the gate runs as a pipeline of the ranks' layers; the result must be one process's: the same
tensors bit for bit (the export's files byte for byte), the same context, the same verdict and
the same logit differences. A rank killed mid-write, a stop of the launcher and a second run on the
same output leave nothing and say what happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from porting import proof
from porting.testing import (
    assert_same_checkpoint,
    child_env,
    processes_mentioning,
    run_in_session,
)

TIMEOUT = 300
RANKS = ("--executor", "torchrun", "--nproc-per-node", "2")


def _import(hf: Path, out: Path, *extra: str, env: dict | None = None):
    argv = [sys.executable, "-m", "porting.cli", "import", str(hf), "--out", str(out), *extra]
    return run_in_session(argv, TIMEOUT, env)


def _qwen3_moe(directory: Path, layers: int, seed: int) -> Path:
    """A tiny Qwen3-MoE HF directory: 4 experts of 48, top-2."""
    return proof.make_hf(
        directory, "Qwen3MoeForCausalLM", seed=seed, vocab_size=130, hidden_size=64,
        intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
        num_experts=4, moe_intermediate_size=48, norm_topk_prob=True, head_dim=32,
    )  # fmt: skip


def _same_verdict(one: dict, two: dict) -> None:
    for key in ("passed", "max_abs_diff", "mean_abs_diff", "top1_agreement", "positions"):
        assert one[key] == two[key], key
    assert one["layers"] == two["layers"]


def _nothing_left(out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] == []


def test_two_ranks_write_the_one_process_checkpoint(tmp_path, cli):
    """A Qwen3-MoE (attention, norms, embeddings, router and experts: every kind of tensor a
    rank's share holds but a dense MLP's, whose making no rank changes) read by the ranks from two
    shards that split layer 0's experts 3 / 1 (Megatron's save spreads the experts over the ranks
    one by one); the one-process reference reads the unsplit model. The dense Llama over two ranks
    against one process: tests/test_slurm.py's two-node import, and verify below."""
    hf = _qwen3_moe(tmp_path / "hf", layers=3, seed=3)
    ranks_hf = _split_experts(hf, tmp_path / "split")
    # the one-process reference in this process: the ranks are what runs as processes here
    one = cli(["import", str(hf), "--out", str(tmp_path / "one"), "--json"])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    two = _import(ranks_hf, tmp_path / "two", "--json", *RANKS, env=child_env(TMPDIR=str(tmp)))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    assert list(tmp.iterdir()) == []  # torchrun's torchelastic_* went with the staging
    assert_same_checkpoint(tmp_path / "one", tmp_path / "two")
    _same_verdict(json.loads(one.stdout), json.loads(two.stdout))
    # our lines only, as one process says them
    said = [line for line in one.logged if line.startswith("imported ")]
    said = [line.replace(str(hf), str(ranks_hf), 1) for line in said]  # the ranks' source
    assert len(said) == 1 and two.stderr.splitlines() == said, two.stderr
    # and back: the ranks write their shares into the planned shards, byte for byte one
    # process's (shards small enough that every rank has several to write into)
    exports = {}
    for name, extra in (("one", ()), ("two", RANKS)):
        argv = ["export", str(tmp_path / name), "--out", str(tmp_path / f"hf-{name}"),
                "--max-shard-gb", "0.00005", "--json", *extra]  # fmt: skip
        if extra:
            done = run_in_session([sys.executable, "-m", "porting.cli", *argv], TIMEOUT)
        else:
            done = cli(argv)
        assert done.returncode == 0, done.stderr[-3000:]
        exports[name] = json.loads(done.stdout)
    _same_verdict(exports["one"], exports["two"])
    files = sorted(p.name for p in (tmp_path / "hf-one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "hf-two").iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) > 2
    for f in files:
        assert (tmp_path / "hf-one" / f).read_bytes() == (tmp_path / "hf-two" / f).read_bytes(), f


_KILL_RANK_1 = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("PORTING_RANKS_STAGING"):
    import signal
    from porting.convert import mapping

    produce = mapping.WeightProducer.__call__

    def dying(self, name):
        value = produce(self, name)
        os.kill(os.getpid(), signal.SIGKILL)  # mid-write: its first tensor made, none written
        return value

    mapping.WeightProducer.__call__ = dying
"""


def test_a_rank_killed_mid_write_fails_the_conversion_and_leaves_nothing(tiny_llama, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_KILL_RANK_1)
    env = child_env(PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "out" / "ckpt"
    r = _import(tiny_llama, out, *RANKS, env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        "porting import: error: rank 1 was killed by signal 9 (SIGKILL); the conversion was "
        "stopped on every rank"
    ), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "torch.distributed" not in r.stderr
    _nothing_left(out)
    assert processes_mentioning(str(out), grace=10) == []


def test_a_stopped_launcher_stops_its_ranks_and_a_second_run_is_refused(tiny_llama, tmp_path):
    out = tmp_path / "out" / "ckpt"
    argv = [sys.executable, "-m", "porting.cli", "import", str(tiny_llama), "--out", str(out)]
    first = subprocess.Popen(
        [*argv, *RANKS], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        # the ranks are at work once the staging directory holds the checkpoint's weights
        while not list(out.parent.glob(f".{out.name}.partial-*/weights")):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        second = run_in_session([*argv, *RANKS], TIMEOUT)
        assert second.returncode == 2 and "another porting run" in second.stderr, second.stderr
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    _nothing_left(out)
    assert processes_mentioning(str(out), grace=10) == []


def test_launch_flags_are_checked_before_anything_starts(tiny_llama, tmp_path):
    out = tmp_path / "ckpt"
    r = _import(tiny_llama, out, "--executor", "torchrun", "--nproc-per-node", "0")
    assert r.returncode == 2 and "--nproc-per-node must be at least 1" in r.stderr
    r = _import(tiny_llama, out, *RANKS, "--whole-model")
    assert r.returncode == 2 and "--whole-model" in r.stderr
    r = _import(tmp_path / "missing", out, *RANKS)
    assert r.returncode == 2 and "missing" in r.stderr
    # started as ranks by a launcher of someone else's, each would convert the whole model
    r = _import(tiny_llama, out, env=child_env(WORLD_SIZE="2", RANK="1"))
    assert r.returncode == 2 and "give --executor torchrun" in r.stderr, r.stderr
    _nothing_left(out)


def test_verify_over_two_ranks_gives_the_one_process_verdict(tiny_llama, tiny_nemo, tmp_path, cli):
    """`porting verify --executor torchrun`: the gate as a pipeline of the ranks' layers gives one
    process's report on a failing model (layer 1, on the second rank, is broken). The passing
    verdict of the same pipeline: the two-rank import's, above."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] *= 1.5
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    argv = ["verify", str(broken), str(tiny_nemo), "--json"]
    one = cli(argv)  # the reference in this process; the ranks are the processes here
    two = run_in_session([sys.executable, "-m", "porting.cli", *argv, *RANKS], TIMEOUT)
    assert (one.returncode, two.returncode) == (1, 1), (one.stderr + two.stderr)[-3000:]
    _same_verdict(json.loads(one.stdout), json.loads(two.stdout))
    assert two.stderr == "", two.stderr
    assert json.loads(two.stdout)["first_divergent_layer"] == 1
    # each process's share of the gate: one process every layer, each rank its own
    shares = [json.loads(r.stdout)["ranks"] for r in (one, two)]
    n = len(json.loads(one.stdout)["layers"])
    assert [(r["rank"], r["layers"]) for r in shares[0]] == [(0, [0, n - 1])], shares[0]
    assert [(r["rank"], r["layers"]) for r in shares[1]] == [
        (0, [0, n // 2 - 1]), (1, [n // 2, n - 1])
    ], shares[1]  # fmt: skip
    assert all(r["cpu_s"] > 0 and r["wall_s"] > 0 for r in shares[0] + shares[1]), shares


def test_the_gates_memory_is_counted_for_every_rank_on_the_node(tiny_llama, monkeypatch, tmp_path):
    """Four ranks on a node each hold a gate at once: what fits one is refused for four."""
    from porting import handoff
    from porting.contract.registry import family_by_name
    from porting.convert import preflight
    from porting.convert.hf_files import read_hf_config
    from porting.convert.table_check import hf_meta_shapes
    from porting.errors import PortingError

    config = read_hf_config(tiny_llama)
    shapes = hf_meta_shapes(family_by_name("llama"), config)
    need, _ = preflight.gate_memory(shapes, False)
    monkeypatch.setattr(preflight, "available_bytes", lambda: 2 * need)
    preflight.check_gate_memory("import", shapes, config, False)  # one process: fits
    # this process as a rank of a launch (porting.handoff: the token in the launch's directory)
    ((name, value),) = handoff.hand_off(
        "PORTING_RANKS_STAGING", tmp_path, stage=str(tmp_path)
    ).items()
    monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(PortingError, match="at once on each of the 4 ranks on this node"):
        preflight.check_gate_memory("import", shapes, config, False)


def _resharded(hf: Path, out: Path, first: callable) -> Path:
    """``hf`` with its tensors split over two shards and an index: those ``first`` picks in
    one, the rest in the other."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf, out)
    weights = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts = ({k: v for k, v in weights.items() if first(k)},
             {k: v for k, v in weights.items() if not first(k)})  # fmt: skip
    for name, part in zip(names, parts, strict=True):
        save_file(part, out / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: names[0] if first(k) else names[1] for k in weights}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _split_experts(hf: Path, out: Path) -> Path:
    """``hf`` (two layers or more of four experts) over two shards: layer 0's experts 0-2 and
    every other layer's expert 0 in the first, the rest in the second."""
    return _resharded(hf, out, lambda k: ".mlp.experts.0." in k or
                      any(f"layers.0.mlp.experts.{e}." in k for e in (1, 2)))  # fmt: skip


def test_an_index_naming_a_missing_shard_is_refused_before_any_rank_starts(tmp_path):
    """An index naming a shard that is not there: refused by the launcher, with its name, before
    any rank starts; nothing left. (A layer's experts split unevenly over shards is the experts' variant of
    test_two_ranks_write_the_one_process_checkpoint.)"""
    hf = _qwen3_moe(tmp_path / "hf", layers=2, seed=5)
    split = _split_experts(hf, tmp_path / "split")
    (split / "model-00001-of-00002.safetensors").unlink()
    out = tmp_path / "out" / "ckpt"
    out.parent.mkdir()
    refused = _import(split, out, *RANKS)
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("porting import: error: "), refused.stderr[-3000:]
    assert "model-00001-of-00002.safetensors" in last, last
    assert "torchrun" not in refused.stderr and "rank " not in refused.stderr, refused.stderr
    _nothing_left(out)
