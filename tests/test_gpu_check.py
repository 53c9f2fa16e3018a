"""scripts/gpu/check.sh at test size on the CPU: the GPU check's whole flow, between GPU loans.

The GPU numbers themselves come only from a GPU machine (docs/training.md); what this proves is
that the one command a short device loan gets has every step working: models, import, data,
parity worker processes (device and a CPU reference with no GPU visible), train, a SIGKILLed and
resumed train, export with its gate, the planner, the report, and ``--continue`` after a call cut
short by its budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from porting.testing import RELEASED_FALCON_LAYOUTS

REPO = Path(__file__).resolve().parents[1]
STEPS = ["models", "import", "data", "parity", "gate", "train stock", "train falcon", "plan", "export",
         "train resume"]  # fmt: skip


def _check(out: Path, work: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    # no wheelhouse here: the test environment is the installed one
    env |= {"PYTHON": sys.executable, "PORTING_WHEELHOUSE": str(work / "no-wheels")}
    return subprocess.run(
        [str(REPO / "scripts" / "gpu" / "check.sh"), str(out), "--tiny", "--work", str(work),
         *flags],
        capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip


def test_check_cut_short_by_its_budget_then_continued_passes_every_check(tmp_path):
    # One of the other families (the loop that builds and imports each): on these two cores every
    # import is a NeMo start-up of its own, 4.7 of the 6.7 minutes with all eleven; each family's
    # import is proven in its own tests.
    out, work = tmp_path / "out", tmp_path / "work"
    first = _check(out, work, "--budget-s", "1", "--families", "mistral")
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"]["models"]["status"] == "done"
    assert {v["status"] for k, v in report["steps"].items() if k != "models"} == {"skipped"}

    done = _check(tmp_path / "out2", work, "--continue", "--budget-s", "1100")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out2" / "report.json").read_text())
    assert report["continued"] == 1
    assert list(report["steps"]) == STEPS
    imported = report["steps"]["import"]["result"]["seconds"]
    assert set(imported) == {"llama-1b", "falcon-1b", "mistral-MistralForCausalLM"} | {
        f"falcon-{name}" for name in RELEASED_FALCON_LAYOUTS
    }
    assert {v["status"] for v in report["steps"].values()} == {"done"}
    assert report["checks"] and all(v["passed"] for v in report["checks"].values()), report[
        "checks"
    ]
    parity = report["steps"]["parity"]["result"]["models"]
    assert set(parity) == {"llama-1b", "falcon-7b_mqa", "falcon-40b_gqa_two_norms",
                           "falcon-11b_gqa_one_norm_untied", "falcon-rw_alibi_biases"}  # fmt: skip
    for name, row in parity.items():
        # the CPU stands in for the device here, so the two fp32 runs must agree exactly
        assert row["fp32_device_vs_cpu"] == {"megatron_max_abs": 0.0, "hf_max_abs": 0.0}, name
        assert row["fp32_gate_on_device"]["passed"] and row["fp32_gate_on_cpu"]["passed"], name
        for side in ("megatron", "hf"):
            bf16 = row["bf16_vs_hf_fp32"][side]
            assert 0 < bf16["max_abs"] < 0.1 and bf16["top1"] > 0.9, (name, side, bf16)
    gate = report["steps"]["gate"]["result"]["gate"]
    assert set(gate) == {"cpu"} and gate["cpu"]["passed"] and gate["cpu"]["floor_ratio"] > 1
    stock = report["steps"]["train stock"]["result"]
    assert stock["loss_last"] < stock["loss_first"] and stock["tokens_per_s"] > 0
    assert report["steps"]["train resume"]["result"]["max_abs_dloss"] <= 1e-5
    plan = report["steps"]["plan"]["result"]
    assert plan["predicted_step_s"] > 0 and plan["comparable"] is False
    table = (tmp_path / "out2" / "report.md").read_text()
    assert "| falcon-rw_alibi_biases |" in table and "every" not in table
    assert "===== train llama, resumed" in (tmp_path / "out2" / "check.log").read_text()


def test_conversion_commands_run_with_no_gpu_visible(tiny_llama, tiny_nemo, tmp_path, monkeypatch):
    """import, export and verify hide the GPUs before anything asks CUDA (porting.cpu.hide_gpus),
    so that a GPU node runs the same gate as the CPU; train keeps them."""
    from porting.cli import main

    for argv in (
        ["verify", str(tiny_llama), str(tiny_nemo)],
        ["import", str(tiny_llama), "--out", str(tmp_path / "nemo"), "--no-verify"],
        ["export", str(tiny_nemo), "--out", str(tmp_path / "hf"), "--no-verify"],
    ):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        assert main(argv) == 0, argv
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "", argv
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    # refused for its missing data; what matters is that training leaves the GPUs visible
    main(["train", "--checkpoint", str(tiny_nemo), "--data", str(tmp_path / "none"), "--out",
          str(tmp_path / "run"), "--dry-run"])  # fmt: skip
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_gpu_without_te_or_apex_keeps_only_the_fusions_it_has_kernels_for(monkeypatch):
    """Plain PyTorch on a GPU (the lent machine's image): Megatron would refuse apply_rope_fusion,
    assert on persist_layer_norm and import a missing softmax kernel; the torch-code fusions stay."""
    from models.falcon import FalconConfig
    from models.llama import LlamaConfig
    from porting import cpu

    missing = cpu.fusions_without_kernels()
    # this environment has neither Transformer Engine nor apex, as that image
    assert set(missing) == {
        "apply_rope_fusion", "masked_softmax_fusion", "persist_layer_norm",
        "gradient_accumulation_fusion",
    }  # fmt: skip
    monkeypatch.setattr(cpu, "cuda_available", lambda: True)
    for config in (
        LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4),
        FalconConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4),
    ):
        assert not any(getattr(config, name) for name in missing), type(config)
        assert config.bias_dropout_fusion, type(config)  # torch code (jit_fuser): kept
        # Falcon's exact GELU has no fused form; the Llama SwiGLU's fusion is torch code
        assert config.bias_activation_fusion == isinstance(config, LlamaConfig), type(config)
        assert not config.use_cpu_initialization, type(config)


def test_a_gpu_without_te_or_apex_saves_torch_adamw_state_without_its_step():
    """The lent H200 (2026-11-26) trained the 1.1B llama 30 bf16 steps and failed its first save:
    without TE or apex Megatron's Adam is torch's AdamW, whose 0-d ``step`` the distributed
    optimizer's ``dp_reshardable`` format took for a flat shard. The fix follows the missing
    kernel, so it is installed under CUDA too, once, and nothing of the CPU's own shims is."""
    code = """
import types, torch
from porting import cpu
cpu.cuda_available = lambda: True
from megatron.core.optimizer import clip_grads, distrib_optimizer as d
assert not d.HAVE_APEX_OR_TE
clip = clip_grads.clip_grad_by_total_norm_fp32
stock = d.DistributedOptimizer._get_main_param_and_optimizer_states
cpu.enable_training()
patched = d.DistributedOptimizer._get_main_param_and_optimizer_states
cpu.enable_training()
assert patched is not stock
assert d.DistributedOptimizer._get_main_param_and_optimizer_states is patched  # wrapped once
assert cpu._TRAINING_MODE is None and clip_grads.clip_grad_by_total_norm_fp32 is clip
main = torch.nn.Parameter(torch.zeros(12))
adam = torch.optim.AdamW([main])
main.grad = torch.ones(12)
adam.step()
assert adam.state[main]["step"].shape == ()
model_param = object()
fake = types.SimpleNamespace(
    model_param_group_index_map={model_param: (0, 0)}, optimizer=adam,
    config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
)
tensors = patched(fake, model_param)
assert sorted(tensors) == ["exp_avg", "exp_avg_sq", "param"], sorted(tensors)
assert all(t.shape == (12,) for t in tensors.values())
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_check", REPO / "scripts" / "gpu" / "check.py"
    )
    module = importlib.util.module_from_spec(spec)
    # its dataclasses look their module up while it executes
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_commands_run_side_by_side_stop_at_the_first_failure_and_name_it(tmp_path):
    import time

    import pytest

    k = _check_module()
    c = k.Check(tmp_path, tmp_path, k.TINY, True, budget_s=60)
    sleeper = [sys.executable, "-c", "import time; print('awake', flush=True); time.sleep(60)"]
    failing = [sys.executable, "-c", "import sys; print('broken input'); sys.exit(3)"]
    t = time.time()
    with pytest.raises(RuntimeError, match=r"^fails: exit 3: broken input"):
        c.run_together([(sleeper, "sleeps", None), (failing, "fails", None)])
    assert time.time() - t < 20  # the sleeper was stopped, not waited for
    log = c.log.read_text()
    assert "===== sleeps" in log and "awake" in log and "broken input" in log
    assert not list(tmp_path.glob(".output-*"))

    both = c.run_together(
        [([sys.executable, "-c", f"print({i})"], f"job {i}", None) for i in (1, 2)]
    )
    assert [o.strip() for o in both] == ["1", "2"]


def test_commands_side_by_side_past_the_budget_are_stopped_and_named(tmp_path):
    import time

    import pytest

    k = _check_module()
    # spent: the floor applies (30 s in a check; 3 s here, so the case does not idle a core)
    c = k.Check(tmp_path, tmp_path, k.TINY, True, budget_s=-100, min_run_s=3)
    quick = [sys.executable, "-c", "print('done')"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    t = time.time()
    with pytest.raises(RuntimeError, match=r"^sleeps: ran past the time budget \(3 s\)"):
        c.run_together([(quick, "quick", None), (sleeper, "sleeps", None)])
    assert 2.9 < time.time() - t < 15
    assert k.Check(tmp_path, tmp_path, k.TINY, True, budget_s=-100).min_run_s == 30
    # where the stopped command was is in the log: its stack, printed before it was killed
    log = c.log.read_text()
    assert "Fatal Python error: Aborted" in log
    assert 'File "<string>", line 1 in <module>' in log.split("===== sleeps")[1]


def test_a_step_named_in_skip_is_not_run_and_unknown_steps_are_refused(tmp_path, capsys):
    k = _check_module()
    c = k.Check(tmp_path, tmp_path, k.TINY, True, budget_s=100, skip=frozenset({"gate"}))
    ran = []
    assert c.step("gate", lambda: ran.append(1)) is None
    assert ran == [] and c.report["steps"]["gate"] == {"status": "skipped", "why": "--skip"}
    _refused_before_any_step(tmp_path, capsys, "--skip", "gate,nosuch", "no step named nosuch")


def _refused_before_any_step(tmp_path, capsys, flag: str, value: str, said: str) -> None:
    import pytest

    with pytest.raises(SystemExit) as stop:
        _check_module().main([str(tmp_path / "out"), "--tiny", "--work", str(tmp_path / "w"), flag,
                              value])  # fmt: skip
    assert stop.value.code == 2
    assert f"{flag}: {said}" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_family_the_check_does_not_know_is_refused_before_any_step(tmp_path, capsys):
    _refused_before_any_step(
        tmp_path, capsys, "--families", "mistral,nosuch", "no installed family named nosuch"
    )
