"""A family from outside the repo, through the scaffold: ``porting new-family`` writes a package,
pip installs it (into a directory of its own put on the path, not into this environment), and the
family then converts end to end through the CLI; what is left to decide is listed all at once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from porting.cli import main
from porting.demo import compare_hf_dirs
from porting.testing import child_env, make_llama


def _pip_target(pkg: Path, site: Path) -> None:
    """``pip install`` the package into ``site`` (no index, no network, no build isolation)."""
    # a rebuild after an edit must not reuse the previous build's copies
    shutil.rmtree(pkg / "build", ignore_errors=True)
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--target",
            str(site),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(pkg),
        ],
        check=True,
        capture_output=True,
    )


def _porting(args: list[str], site: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = child_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "porting.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_scaffold_for_plain_llama_passes_its_own_test_unmodified(tmp_path):
    hf = make_llama(tmp_path / "hf")
    pkg, site = tmp_path / "pkg", tmp_path / "site"
    assert main(["new-family", "plainllama", "--from", str(hf), "--out", str(pkg)]) == 0
    _pip_target(pkg, site)
    env = child_env(PYTHONPATH=str(site))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pkg / "tests")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "6 passed" in run.stdout, run.stdout[-2000:]


def test_an_auto_map_family_goes_end_to_end_through_the_cli_once_decided(tmp_path, capsys):
    """A Llama variant with one twist: its own architecture and model_type with auto_map code
    (never run); the HF reference side is transformers' Llama."""
    hf = make_llama(tmp_path / "hf", num_layers=3)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(
        architectures=["InHouseForCausalLM"],
        model_type="inhouse",
        auto_map={"AutoModelForCausalLM": "modeling_inhouse.InHouseForCausalLM"},
    )
    (hf / "config.json").write_text(json.dumps(cfg))
    pkg, site = tmp_path / "pkg", tmp_path / "site"

    # no transformers class of that name: the scaffold asks for one
    assert main(["new-family", "inhouse", "--from", str(hf), "--out", str(pkg)]) == 2
    assert "--hf-class" in capsys.readouterr().err
    code = main(
        [
            "new-family",
            "inhouse",
            "--from",
            str(hf),
            "--out",
            str(pkg),
            "--hf-class",
            "LlamaForCausalLM",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "claims: InHouseForCausalLM" in out
    assert "still to decide: auto_map" in out, out

    # installed as written, the family is refused with what is left, before any tensor is read
    _pip_target(pkg, site)
    run = _porting(["import", str(hf), "--out", str(tmp_path / "ck"), "--no-verify"], site)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "family inhouse (" in run.stderr and "converter.py" in run.stderr
    assert "1 HF config field(s) still to decide: auto_map" in run.stderr
    assert not (tmp_path / "ck").exists()

    # the author's decision: auto_map names code we never run, so it does not change the maths
    conv = pkg / "porting_family_inhouse" / "converter.py"
    text = conv.read_text()
    text = text.replace(
        "from porting.contract.config_map import Require, Undecided",
        "from porting.contract.config_map import Carry, Require",
    )
    text = "\n".join(
        '    Carry("auto_map"),' if line.startswith("    Undecided('auto_map'") else line
        for line in text.splitlines()
    )
    conv.write_text(text + "\n")
    _pip_target(pkg, site)

    listed = _porting(["families", "--json"], site)
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["inhouse"]["package"] == "porting-family-inhouse 0.1.0"
    assert rows["inhouse"]["architectures"] == ["InHouseForCausalLM"]

    ck, back = tmp_path / "ck", tmp_path / "back"
    run = _porting(["import", str(hf), "--out", str(ck)], site)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "parity PASS" in run.stdout
    run = _porting(["verify", str(hf), str(ck), "--json"], site)
    assert run.returncode == 0 and json.loads(run.stdout)["passed"], run.stderr[-3000:]
    run = _porting(["export", str(ck), "--out", str(back)], site)
    assert run.returncode == 0, run.stderr[-3000:]
    assert compare_hf_dirs(hf, back).exact
    assert json.loads((back / "config.json").read_text())["auto_map"] == cfg["auto_map"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["Bad-Name"], "lower case letters"),
        (["tsuzumi"], "already installed"),
        (["class"], "lower case letters"),
    ],
)
def test_new_family_refuses_bad_names(args, needle, tmp_path, capsys):
    hf = make_llama(tmp_path / "hf")
    assert main(["new-family", *args, "--from", str(hf), "--out", str(tmp_path / "p")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_new_family_keeps_an_existing_output(tmp_path, capsys):
    hf = make_llama(tmp_path / "hf")
    out = tmp_path / "p"
    out.mkdir()
    (out / "mine").write_text("keep")
    assert main(["new-family", "x1", "--from", str(hf), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "mine").read_text() == "keep"


def test_new_family_reads_no_pickle_and_no_path_outside_the_checkpoint(tmp_path, capsys):
    """The scaffold reads names only, through the same checks as import: pickle weights are
    refused, and a config.json that is a symlink out of the directory is not followed."""
    import torch
    from safetensors.torch import load_file

    hf = make_llama(tmp_path / "hf")
    torch.save(load_file(hf / "model.safetensors"), hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    out = tmp_path / "p"
    assert main(["new-family", "x2", "--from", str(hf), "--out", str(out)]) == 2
    assert "pickle" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text((hf / "config.json").read_text())
    (hf / "config.json").unlink()
    (hf / "config.json").symlink_to(elsewhere)
    assert main(["new-family", "x2", "--from", str(hf), "--out", str(out)]) == 2
    assert "outside the model directory" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".p-*"))
