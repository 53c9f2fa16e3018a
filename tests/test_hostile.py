"""Checkpoints made by others run no code and reach no path outside themselves; concurrent and
stopped runs lose nothing; outputs follow the umask.

The io.json attack is the real one: NeMo's own ``load_context`` is shown to run it first.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from porting.cli import main
from porting.testing import still_running


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}


def _porting(*args, cwd=None, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "porting.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env or _clean_env(),
        **kw,
    )


def _nothing_under(out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")] == []


def _poison(ckpt: Path, field: str, marker: Path) -> None:
    """Rewrite ``ckpt``'s io.json so that building ``field`` runs ``touch MARKER``."""
    import fiddle as fdl
    from fiddle._src.experimental import serialization
    from nemo.lightning.io import load_context

    cfg = load_context(ckpt / "context", build=False)
    evil = fdl.Config(subprocess.getoutput, cmd=f"touch {marker}")
    if field == "optimizer":
        cfg.model.optim.config.optimizer = evil
    else:
        cfg.model.tokenizer = evil
    (ckpt / "context" / "io.json").write_text(serialization.dump_json(cfg))


@pytest.fixture
def ckpt(tiny_nemo, tmp_path):
    """A private copy of the imported tiny checkpoint that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_nemo, dst)
    return dst


def _edit_manifest(ckpt: Path, **changes) -> None:
    path = ckpt / "context" / "porting.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.nemo2  # NeMo (and fiddle) write the poison and run it
@pytest.mark.parametrize("field", ["optimizer", "tokenizer"])
def test_a_poisoned_io_json_really_runs_code_in_nemo(ckpt, tmp_path, field):
    """Positive control: the crafted file is a working attack on NeMo's own loader."""
    from nemo.lightning.io import load_context

    marker = tmp_path / "PWNED"
    _poison(ckpt, field, marker)
    with pytest.raises(Exception):  # noqa: B017 - the tokenizer variant builds, then fails
        load_context(ckpt / "context", subpath="model")
        raise RuntimeError("built")
    assert marker.exists()


@pytest.mark.nemo2  # NeMo (and fiddle) write the poison
@pytest.mark.parametrize("field", ["optimizer", "tokenizer"])
def test_verify_export_and_train_refuse_a_poisoned_io_json(
    ckpt, tiny_llama, tmp_path, capsys, field
):
    marker = tmp_path / "PWNED"
    _poison(ckpt, field, marker)
    where = "<root>.model.optim.config.optimizer" if field == "optimizer" else "<root>.model"
    runs = {
        "verify": ["verify", str(tiny_llama), str(ckpt)],
        "export": ["export", str(ckpt), "--out", str(tmp_path / "out")],
        "train": [
            "train",
            "--checkpoint",
            str(ckpt),
            "--data",
            str(tmp_path / "no-data"),
            "--out",
            str(tmp_path / "run"),
            "--dry-run",
        ],
    }
    for name, argv in runs.items():
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        assert "subprocess.getoutput" in err and where in err and "io.json" in err, (name, err)
        assert not marker.exists(), name
    _nothing_under(tmp_path / "out")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.nemo2  # what NeMo writes
def test_allow_list_admits_what_nemo_writes_and_nothing_else(tiny_nemo):
    from porting.convert.context import allowed, check_io_json

    check_io_json(tiny_nemo)
    assert allowed("models.tsuzumi", "TsuzumiModel")
    assert allowed("torch", "bfloat16")
    for module, name in [
        ("subprocess", "getoutput"),
        ("os", "system"),
        ("builtins", "eval"),
        ("nemo.collections.llm.api", "export_ckpt"),  # a NeMo function, not a class
        ("porting.train.launch", "launch_nemo_run"),  # ours, but a function that launches
        ("nemo.collections.llm.gpt.model.base", "Path"),  # a class re-exported from elsewhere
        ("torch", "load"),
    ]:
        assert not allowed(module, name), (module, name)


def test_a_family_s_context_symbols_are_allowed_for_its_checkpoints_only():
    from converters import falcon, gemma
    from porting.convert.context import allowed

    assert not allowed("models.falcon", "falcon_layer_spec")
    assert allowed("models.falcon", "falcon_layer_spec", falcon.FAMILY)
    assert not allowed("models.gemma", "gelu_tanh", falcon.FAMILY)
    assert allowed("models.gemma", "gelu_tanh", gemma.FAMILY)
    # a function of the family's module that it did not declare stays out
    assert not allowed("models.gemma", "gemma_block_spec", falcon.FAMILY)
    assert not allowed("models.falcon", "alibi_bias", falcon.FAMILY)


def test_a_family_s_named_context_symbols_are_allowed_in_a_bridge_run_config_for_it_only():
    """Families name their symbols ("models.falcon:falcon_layer_spec"): Bridge's run_config.yaml
    check admits them for that family's checkpoints and refuses them for another's."""
    from converters import falcon, gemma
    from porting.convert.bridge import _check_targets
    from porting.errors import PortingError

    spec = {"model": {"transformer_layer_spec": {"_target_": "models.falcon.falcon_layer_spec"}}}
    _check_targets(spec, Path("run_config.yaml"), falcon.FAMILY)
    with pytest.raises(PortingError, match="falcon_layer_spec"):
        _check_targets(spec, Path("run_config.yaml"), gemma.FAMILY)


def test_trust_remote_code_in_io_json_is_refused(ckpt):
    from porting.convert.context import check_io_json
    from porting.errors import PortingError

    path = ckpt / "context" / "io.json"
    data = json.loads(path.read_text())
    tok = next(k for k in data["objects"] if k.startswith("auto_tokenizer"))
    data["objects"][tok]["items"].append(
        ["Attr(name='trust_remote_code')", {"type": "leaf", "value": True, "paths": []}]
    )
    path.write_text(json.dumps(data))
    with pytest.raises(PortingError, match="trust_remote_code"):
        check_io_json(ckpt)


def test_extra_files_cannot_write_outside_the_export(ckpt, tmp_path, capsys):
    (ckpt / "context" / ".bashrc").write_text("echo pwned\n")
    _edit_manifest(ckpt, extra_files=["../.bashrc"])
    victim = tmp_path / ".bashrc"
    victim.write_text("mine\n")
    code = main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2 and "extra_files" in err and "porting.json" in err, err
    assert victim.read_text() == "mine\n"
    _nothing_under(tmp_path / "out")


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink_dir", "symlink_file"])
def test_tokenizer_path_stays_inside_the_checkpoint(ckpt, tmp_path, capsys, kind):
    outside = tmp_path / "outside"
    shutil.copytree(ckpt / "context" / "nemo_tokenizer", outside)
    (outside / "id_rsa").write_text("SECRET")
    tok = ckpt / "context" / "nemo_tokenizer"
    if kind == "absolute":
        _edit_manifest(ckpt, tokenizer={"kind": "hf", "path": str(outside)})
    elif kind == "dotdot":
        _edit_manifest(ckpt, tokenizer={"kind": "hf", "path": "../../../../../../../etc"})
    elif kind == "symlink_dir":
        shutil.rmtree(tok)
        tok.symlink_to(outside)
    else:
        (tok / "id_rsa").symlink_to(outside / "id_rsa")
    out = tmp_path / "out"
    code = main(["export", str(ckpt), "--out", str(out), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2 and "tokenizer" in err, err
    _nothing_under(out)


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"vocab_size": "130"}, "vocab_size"),
        ({"padded_vocab_size": 3}, "padded_vocab_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"hf_config": []}, "hf_config"),
        ({"surprise": 1}, "surprise"),
        ({"tokenizer": {"kind": "sentencepiece", "path": "context/x"}}, "tokenizer"),
        ({"version": 99}, "version"),
        ({"fp32_tensors": "model.layers.0.mlp.gate.e_score_correction_bias"}, "fp32_tensors"),
        ({"fp32_tensors": [3]}, "fp32_tensors"),
        ({"hf_experts": "sideways"}, "hf_experts"),
        ({"hf_experts": ["stacked"]}, "hf_experts"),
    ],
)
def test_a_malformed_manifest_is_named(ckpt, tmp_path, capsys, changes, needle):
    _edit_manifest(ckpt, **changes)
    code = main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2 and "porting.json" in err and needle in err, err
    assert "Traceback" not in err
    _nothing_under(tmp_path / "out")


def test_outputs_follow_the_umask(tiny_llama, tmp_path):
    old = os.umask(0o022)
    try:
        assert main(["import", str(tiny_llama), "--out", str(tmp_path / "ck"), "--no-verify"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o755


def test_disk_full_is_a_located_error_and_leaves_nothing(ckpt, tmp_path, capsys, monkeypatch):
    from porting.convert import export

    def full(src, dst, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(export.shutil, "copyfile", full)
    out = tmp_path / "out"
    code = main(["export", str(ckpt), "--out", str(out), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2 and "no space left" in err and str(tmp_path) in err, err
    _nothing_under(out)


@pytest.mark.parametrize(
    "refused",
    [
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 30857282560 bytes. Error code 12 (Cannot allocate "
            "memory)"
        ),
        MemoryError(),
    ],
    ids=["torch_allocator", "memory_error"],
)
def test_memory_exhausted_is_one_line_and_leaves_nothing(
    refused, ckpt, tmp_path, capsys, monkeypatch
):
    from porting.convert import export

    def exhausted(src, dst, *a, **k):
        raise refused

    monkeypatch.setattr(export.shutil, "copyfile", exhausted)
    out = tmp_path / "out"
    code = main(["export", str(ckpt), "--out", str(out), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("porting export: error: out of memory ("), line
    assert line.endswith("; partial output removed"), line
    assert "alloc_cpu" not in line and ("30857282560 bytes" in line) == isinstance(
        refused, RuntimeError
    ), line
    _nothing_under(out)


def test_a_second_run_on_the_same_output_fails_at_once(tiny_llama, tmp_path):
    """Two real `porting import` processes on one output: the second exits 2 naming the first."""
    from porting.guard import lock_path

    out = tmp_path / "ck"
    first = _porting("import", tiny_llama, "--out", out)
    lock = lock_path(out)
    deadline = time.monotonic() + 120
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock.exists(), first.communicate()
    # the first run now holds the lock and is still importing NeMo; stop it there so the test
    # does not race its completion
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = _porting("import", tiny_llama, "--out", out)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2, err
        assert f"pid {first.pid}" in err and "another porting run" in err
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert (out / "context" / "porting.json").exists() and not lock.exists()


def _tree(proc: psutil.Process) -> set[int]:
    try:
        return {proc.pid} | {c.pid for c in proc.children(recursive=True)}
    except psutil.Error:
        return set()


def _cmdline(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:200]}"
    return f"{pid}: gone"


def _stop_at(tmp_path: Path, src: Path, when, sig=signal.SIGTERM) -> tuple[int, str, set[int]]:
    """Run `porting import SRC`, send ``sig`` once ``when(out)`` holds; returns (code, err, pids)."""
    out = tmp_path / "ck"
    # A temp directory of its own: what the run leaves there is the run's, whatever else runs.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _porting("import", src, "--out", out, env=_clean_env() | {"TMPDIR": str(tmp)})
    ps = psutil.Process(proc.pid)
    pids: set[int] = set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and not when(out) and time.monotonic() < deadline:
        pids |= _tree(ps)
        time.sleep(0.02)
    pids |= _tree(ps)
    assert proc.poll() is None, "the run ended before the signal point"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    alive = still_running(pids, grace=15)
    assert alive == [], [_cmdline(p) for p in alive]
    if sig == signal.SIGKILL:
        assert not out.exists()  # the partial directory stays; the next run removes it
    else:
        _nothing_under(out)
    leaked = {p.name for p in tmp.iterdir() if "porting" in p.name}
    assert leaked == set()
    return proc.returncode, err, pids


def _partial_has_weights(out: Path) -> bool:
    return any(p.glob("weights/*.distcp") for p in out.parent.glob(f".{out.name}.partial-*"))


@pytest.fixture(scope="module")
def medium_llama(tmp_path_factory):
    """Large enough that import and the gate take a few seconds (signal points to hit)."""
    from porting.testing import make_llama

    return make_llama(
        tmp_path_factory.mktemp("hf") / "medium",
        hidden_size=256,
        num_layers=6,
        intermediate_size=700,
        num_heads=8,
        num_kv_heads=2,
    )


@pytest.mark.parametrize(
    "point",
    ["start-up", "holding the lock", "weights written (gate running)"],
)
def test_sigterm_during_import_leaves_nothing(medium_llama, tmp_path, point):
    from porting.guard import lock_path

    when = {
        "start-up": lambda out: True,
        "holding the lock": lambda out: lock_path(out).exists(),
        "weights written (gate running)": _partial_has_weights,
    }[point]
    code, err, _ = _stop_at(tmp_path, medium_llama, when)
    # before Python has installed our handler, the default action ends the process (-15)
    assert code == 143 or (point == "start-up" and code == -signal.SIGTERM), err
    if point != "start-up":
        assert "porting import: stopped by SIGTERM; partial outputs removed" in err, err


def test_sighup_during_import_exits_129(medium_llama, tmp_path):
    from porting.guard import lock_path

    code, err, _ = _stop_at(
        tmp_path, medium_llama, lambda out: lock_path(out).exists(), signal.SIGHUP
    )
    assert code == 129 and "stopped by SIGHUP" in err, err


def _gate_holds_hidden_states(out: Path) -> bool:
    return any(p.glob(".porting-parity-*/*.pt") for p in out.parent.glob(f".{out.name}.partial-*"))


def test_sigkill_during_import_leaves_no_process_and_no_output(medium_llama, tmp_path):
    """What the out-of-memory killer does: no handler runs, yet no worker outlives the run, and
    the gate's hidden states (written to disk) stay inside the partial directory, not in /tmp."""
    code, _, pids = _stop_at(tmp_path, medium_llama, _gate_holds_hidden_states, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert list(tmp_path.glob(".ck.partial-*"))  # left for the next run to clean up
