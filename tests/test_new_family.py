"""A family from outside the repo, through the scaffold: ``porting new-family`` writes a package
started from the closest installed family, pip installs it (into a directory of its own put on
the path, not into this environment), and the family then converts end to end through the CLI;
what is left to decide is listed all at once. The StableLM-2 case (LayerNorm with biases, partial
rotary, q/k/v biases) is scaffolded, its flags checked, its decisions filled in and gated.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from porting import proof, scaffold
from porting.cli import main
from porting.commands.demo import compare_hf_dirs
from porting.testing import child_env, make_llama

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "families.md"


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


# Several `porting` commands in one interpreter, as an installed family's user would run them
# one after another: what each printed and its exit status, split at a line of our own.
_IN_TURN = """
import json, sys
from porting.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    for stream in (sys.stdout, sys.stderr):
        print(f"\\n{sys.argv[2]} {code}", file=stream, flush=True)
"""


def _porting_in_turn(argvs: list[list[str]], site: Path) -> list[subprocess.CompletedProcess]:
    """``porting ARGV`` for each of ``argvs`` in one interpreter that has the family at ``site``
    on its path: the family's CLI end to end, paying one NeMo start-up, not one per command."""
    env = child_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    mark = "@@porting-command-done"
    run = subprocess.run(
        [sys.executable, "-c", _IN_TURN, json.dumps(argvs), mark],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # each stream: command 0's text, then for each command "<its exit> \n<the next one's text>"
    outs, errs = (text.split(f"\n{mark} ") for text in (run.stdout, run.stderr))
    done = []
    for i, argv in enumerate(argvs):
        out = outs[i].partition("\n")[2] if i else outs[0]
        err = errs[i].partition("\n")[2] if i else errs[0]
        code = int(outs[i + 1].partition("\n")[0])
        done.append(subprocess.CompletedProcess(argv, code, out, err))
    return done


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
    # the proof on the config it started from, and parity and round trip on the toggled variant
    assert "8 passed" in run.stdout, run.stdout[-2000:]


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

    ck, back = tmp_path / "ck", tmp_path / "back"
    # and planned from its checkpoint with no planner edit (the family's reading: the Llama's)
    plan = ["plan", "--model", str(ck), "--cluster", "examples/clusters/dgx-h100-one-site.yaml",
            "--global-batch", "64", "--seq-length", "256", "--json"]  # fmt: skip
    listed, imported, verified, exported, planned = _porting_in_turn(
        [["families", "--json"], ["import", str(hf), "--out", str(ck)],
         ["verify", str(hf), str(ck), "--json"], ["export", str(ck), "--out", str(back)], plan],
        site,
    )  # fmt: skip
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["inhouse"]["package"] == "porting-family-inhouse 0.1.0"
    assert rows["inhouse"]["architectures"] == ["InHouseForCausalLM"]
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert "parity PASS" in imported.stdout
    assert verified.returncode == 0, verified.stderr[-3000:]
    assert json.loads(verified.stdout)["passed"]
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert compare_hf_dirs(hf, back).exact
    assert json.loads((back / "config.json").read_text())["auto_map"] == cfg["auto_map"]
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert json.loads(planned.stdout)["model"]["layers"] == 3


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


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors() -> set[str]:
    return {
        _slug(line.lstrip("#"))
        for line in GUIDE.read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    }


def _stablelm(root: Path) -> Path:
    """A tiny StableLM-2: LayerNorm with biases, a quarter of each head rotated, q/k/v biases,
    grouped query heads."""
    return proof.make_hf(
        root,
        "StableLmForCausalLM",
        vocab_size=130,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        partial_rotary_factor=0.25,
        use_qkv_bias=True,
    )


# What an author who knows HF writes for StableLM-2 where the scaffold says Undecided, with the
# key table of docs/families.md: (the generated line's start, its replacement).
_STABLELM_DECISIONS = {
    "    Undecided('hidden_dropout',": "    Require('hidden_dropout', lambda v: v == 0, 'off'),",
    "    Undecided('layer_norm_eps',": "    Field('layer_norm_eps', 'layernorm_epsilon'),",
    "    Undecided('partial_rotary_factor',": "    Field('partial_rotary_factor', 'rotary_percent'),",
    "    Undecided('qk_layernorm',": "    Require('qk_layernorm', lambda v: v is False, 'off'),",
    "    Undecided('use_parallel_residual',": (
        "    Require('use_parallel_residual', lambda v: v is False, 'sequential'),"
    ),
    "    Undecided('use_qkv_bias',": "    Field('use_qkv_bias', 'add_qkv_bias'),",
    "from porting.contract.family import Family": (
        "from porting.contract.config_map import Field\n"
        "from porting.contract.family import Family\n"
        "from porting.contract.mapping import Rename"
    ),
    "WEIGHTS = (*BASE.weights,)": (
        "WEIGHTS = (\n"
        "    *BASE.weights,\n"
        "    Rename('model.layers.*.input_layernorm.bias', 'decoder.layers.*.input_layernorm.bias'),\n"
        "    Rename(\n"
        "        'model.layers.*.post_attention_layernorm.bias',\n"
        "        'decoder.layers.*.pre_mlp_layernorm.bias',\n"
        "    ),\n"
        "    Rename('model.norm.bias', 'decoder.final_layernorm.bias'),\n"
        ")"
    ),
}


def _decide(path: Path, decisions: dict[str, str]) -> int:
    """Apply ``decisions`` to the generated file; the number of lines the author wrote."""
    out, written = [], 0
    for line in path.read_text().splitlines():
        for start, new in decisions.items():
            if line.startswith(start):
                line = new
                written += len([x for x in new.splitlines() if x.strip()])
                break
        out.append(line)
    path.write_text("\n".join(out) + "\n")
    return written


def test_the_stablelm2_case_is_flagged_then_decided_and_gated(tmp_path, capsys):
    """The issue's case as an outside plugin: the scaffold starts from the family whose table
    reads q/k/v biases alone (Qwen's; Llama's bias entries read an o_proj bias too), flags
    rms_norm_eps (the base requires it, StableLM has layer_norm_eps), lists the norm biases from
    the HF class's own state dict, says LayerNorm; once the flags are decided the gate passes and
    the round trip is exact."""
    hf = _stablelm(tmp_path / "hf")
    pkg, site = tmp_path / "pkg", tmp_path / "site"
    began = time.perf_counter()
    assert main(["new-family", "stablelm2", "--from", str(hf), "--out", str(pkg)]) == 0
    took = time.perf_counter() - began
    out = capsys.readouterr().out
    print(f"scaffold: {took:.1f} s")
    assert "started from family qwen:" in out and "qwen (tensors 15/18" in out, out
    assert "llama (tensors 12/18" in out, out
    assert "lacks (Undecided): rms_norm_eps" in out
    assert "normalization='LayerNorm'" in out
    for key in ("layer_norm_eps", "partial_rotary_factor", "use_qkv_bias"):
        assert key in out.split("still to decide: ")[1].splitlines()[0]
    undecided_tensors = out.split("table reads (Undecided): ")[1].splitlines()[0]
    assert undecided_tensors == (
        "model.layers.*.input_layernorm.bias, model.layers.*.post_attention_layernorm.bias, "
        "model.norm.bias"
    )
    conditional = out.split("(a when): ")[1].splitlines()[0]
    for t in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.*.self_attn.{t}.bias" in conditional
    conv = pkg / "porting_family_stablelm2" / "converter.py"
    text = conv.read_text()
    assert "from converters.qwen import FAMILY as BASE" in text
    assert "Undecided('partial_rotary_factor', 0.25),  # Megatron-Core: rotary_percent" in text

    # installed as written, the family is refused listing everything left, before a tensor is read
    _pip_target(pkg, site)
    run = _porting(["import", str(hf), "--out", str(tmp_path / "ck0"), "--no-verify"], site)
    assert run.returncode == 2 and "10 HF config field(s) still to decide" in run.stderr
    assert "model.norm.bias (seen 'an HF tensor no entry of WEIGHTS reads')" in run.stderr

    # every flagged field and tensor decided: the two lists emptied (rms_norm_eps stays REPLACED)
    emptied = re.sub(r"\n(MISSING|TENSORS_TO_DECIDE) = \(\n[^)]*\)", r"\n\1 = ()", conv.read_text())
    assert emptied.count(" = ()") == 2
    conv.write_text(emptied)
    written = 2 + _decide(conv, _STABLELM_DECISIONS)
    model = pkg / "porting_family_stablelm2" / "model.py"
    model.write_text(
        model.read_text().replace(
            '    """Megatron GPT config of the stablelm2 family."""\n',
            '    """Megatron GPT config of the stablelm2 family."""\n\n'
            '    normalization: str = "LayerNorm"\n',
        )
    )
    written += 1
    print(f"lines the author wrote: {written}")
    assert written <= 25  # the author wrote 194
    _pip_target(pkg, site)
    ck, back = tmp_path / "ck", tmp_path / "back"
    imported, exported = _porting_in_turn(
        [["import", str(hf), "--out", str(ck)], ["export", str(ck), "--out", str(back)]], site
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert "parity PASS" in imported.stdout
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert compare_hf_dirs(hf, back).exact


def test_base_picks_the_family_to_start_from(tmp_path, capsys):
    hf = _stablelm(tmp_path / "hf")
    out = tmp_path / "p"
    assert main(["new-family", "s2", "--from", str(hf), "--out", str(out), "--base", "llama"]) == 0
    said = capsys.readouterr().out
    assert "started from family llama:" in said and "closest first: llama (" in said
    # Llama's bias entries need an o_proj bias too: with it as base, q/k/v biases are to decide
    assert "model.layers.*.self_attn.q_proj.bias" in said.split("(Undecided): ")[2]
    text = (out / "porting_family_s2" / "converter.py").read_text()
    assert "from converters.llama import FAMILY as BASE" in text
    # its Megatron config NeMo-free on Llama's, its NeMo classes on Llama's NeMo ones
    model = (out / "porting_family_s2" / "model.py").read_text()
    assert "from models.llama import LlamaCore as BaseCore" in model
    assert "import nemo" not in model and "from nemo" not in model
    nemo = (out / "porting_family_s2" / "model_nemo.py").read_text()
    assert "from models.llama_nemo import LlamaConfig as BaseConfig" in nemo
    assert "S2Config, S2Model = nemo_classes(S2Core, BaseConfig, __name__)" in nemo
    assert "core_config_cls='porting_family_s2.model:S2Core'" in text
    other = tmp_path / "q"
    assert main(["new-family", "s3", "--from", str(hf), "--out", str(other), "--base", "nope"]) == 2
    assert "no installed family of that name" in capsys.readouterr().err
    assert not other.exists()


@pytest.mark.parametrize(
    "arch,base",
    [
        ("Qwen3MoeForCausalLM", "moe"),
        ("DeepseekV2ForCausalLM", "deepseek-v2"),
        ("Llama4ForCausalLM", "llama4"),
    ],
)
def test_a_mixture_of_experts_starts_from_its_family_with_no_tensor_to_decide(arch, base, tmp_path):
    """transformers 5 holds a mixture's experts stacked in the model it builds and stores them
    one tensor each, as published: the scaffold reads the stored names, so the family whose
    table reads them covers every tensor (the stacks were listed as undecided before)."""
    hf = proof.make_hf(tmp_path / "hf", arch, **proof.tiny_fields(arch))
    done = scaffold.new_family("mixture", hf, tmp_path / "p")
    assert done.base == base
    assert done.uncovered_tensors == [] and done.undecided == [] and done.missing == []


def test_every_guide_section_the_scaffold_points_to_exists(tmp_path):
    hf = _stablelm(tmp_path / "hf")
    out = tmp_path / "p"
    done = scaffold.new_family("anchors", hf, out)
    texts = [p.read_text() for p in out.rglob("*.py")] + [done.summary()]
    pointed = {a for t in texts for a in re.findall(r"docs/families\.md#([\w-]+)", t)}
    assert pointed >= {scaffold.GUIDE_KEYS, scaffold.GUIDE_TABLE, scaffold.GUIDE_MEGATRON}
    assert pointed - _anchors() == set()
    assert scaffold.GUIDE_START in _anchors()


def test_the_guide_has_the_scaffolds_key_table():
    """docs/families.md's HF key -> Megatron-Core table is the one the scaffold writes beside
    each Undecided field, row for row."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("### HF config keys and Megatron-Core fields")[1].split("\n#")[0]
    rows = {}
    for line in section.splitlines():
        m = re.fullmatch(r"\| `([^`]+)` \| (.+) \|", line)
        if m:
            rows[m[1]] = m[2].replace("`", "")
    assert rows == scaffold.HINTS
