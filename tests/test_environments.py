"""The package's ranges and the two lock sets (scripts/locks/, docs/environments.md): each lock
meets every requirement pyproject.toml declares for its environment, and pip, asked to install
this checkout where a lock set is installed, installs nothing but porting (a Megatron-Bridge user's
Megatron-Core, Bridge and transformers stay as they are). Runs on both stacks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCKS = sorted((ROOT / "scripts" / "locks").glob("*.lock"))


def _check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_the_two_lock_sets():
    assert {p.stem for p in LOCKS} == set(_check_lock().ENV_EXTRAS) == {"current", "nemo2"}


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.stem)
def test_each_lock_meets_every_range_the_package_declares(lock):
    check = _check_lock()
    python, extras = check.ENV_EXTRAS[lock.stem]
    assert check.unmet(check.requirements(extras), check.read_lock(lock), python) == []


def test_the_current_set_is_the_stack_bridge_users_have():
    pins = _check_lock().read_lock(ROOT / "scripts" / "locks" / "current.lock")
    assert pins["megatron-bridge"] == "0.6.2"
    assert pins["megatron-core"] == "0.19.2"
    assert pins["transformers"] == "5.12.1"
    assert "nemo-toolkit" not in pins


def test_the_nemo2_set_is_nemo_2s_last_llm_stack():
    pins = _check_lock().read_lock(ROOT / "scripts" / "locks" / "nemo2.lock")
    assert pins["nemo-toolkit"] == "2.7.3"
    assert pins["megatron-core"] == "0.15.3"
    assert pins["transformers"].startswith("4.57.")
    assert pins["torch"] == "2.13.0"


def test_a_pin_outside_a_range_or_missing_is_named(tmp_path):
    check = _check_lock()
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\ndependencies = ["transformers>=4.57,<6", "safetensors>=0.6"]\n'
        '[project.optional-dependencies]\nx = ["megatron-core>=0.15.3,<0.20"]\n'
    )
    lock = tmp_path / "current.lock"
    lock.write_text("# a header\ntransformers==6.0.0\nMegatron_Core==0.20.0\n")
    said = check.unmet(check.requirements(("x",), pyproject), check.read_lock(lock), "3.12")
    assert said == [
        "transformers<6,>=4.57: the set has 6.0.0",
        "safetensors>=0.6: not in the set",
        "megatron-core<0.20,>=0.15.3: the set has 0.20.0",
    ]
    lock.write_text("transformers>=5\n")
    with pytest.raises(ValueError, match=r"current.lock:1: 'transformers>=5' is not"):
        check.read_lock(lock)


def test_installing_this_checkout_here_changes_nothing_else(tmp_path):
    """pip's own resolver, offline: every requirement is met by what this environment holds
    (--no-index would fail on any that is not), and the plan installs porting alone."""
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet",
         "--no-build-isolation", "--report", str(report), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    planned = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert planned == ["porting"]


def test_train_without_nemo2_is_refused_naming_the_environment_to_use(monkeypatch):
    import importlib.util

    from porting.commands import train as cli
    from porting.errors import PortingError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "nemo" else real(name, *a)
    )
    with pytest.raises(PortingError, match=r"lacks nemo .*scripts/env.sh nemo2 -- porting train"):
        cli._need_engine("nemo2")
