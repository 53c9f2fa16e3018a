"""``porting new-family`` on hostile checkpoints (issue 35): nothing read from the checkpoint runs
when the generated family is imported, whatever it holds (quotes, triple quotes, backslashes,
line breaks of every kind, ``#``, format braces, NUL, very long text), in whichever place (the
model type, the architecture, a field's name or value, nested values, a tensor name); each value
arrives as data. Bad family names and an ``--out`` that overlaps the input exit 2 with one line
and touch nothing.

The generated packages are imported for real, all in one child process (NeMo is imported once),
and each payload would create a marker file if any of it ran.
"""

from __future__ import annotations

import ast
import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from porting import scaffold
from porting.cli import main
from porting.testing import child_env, make_llama


def _breakouts(mark: Path) -> dict[str, str]:
    """Texts that run ``touch(mark)`` if they escape a string, docstring, comment or template."""
    run = f"__import__('pathlib').Path({str(mark)!r}).touch()"
    shell = f"__import__('os').system('touch {mark}')"
    return {
        "single_quote": f"'); {run}; ('",
        "double_quote": f'"); {run}; ("',
        "triple_single": f"''');{run};'''",
        "triple_double": f'""";{run};"""',
        "docstring_close": f'"""\n{run}\n"""',
        "backslash": f"\\'); {run}; ('\\",
        "newline": f"x\n{run}\n#",
        "carriage_return": f"\r{run}\r#",
        "crlf": f"\r\n{shell}\r\n",
        "line_separator": f"\u2028{run}\u2028#",
        "next_line": f"\x85{run}\x85",
        "form_feed": f"\x0c\x0b\n{run}\n",
        "hash": f"# {run}\n{run}",
        "format_braces": "{" + run + "}{0}{name}{{}}{!r}",
        "nul": f"\x00\n{shell}",
        "long": "x" * 20_000 + f"\n{run}\n",
        "unicode": f"é中\U0001f600\u202e\n{run}",
        "lone_surrogate": f"\ud800\n{run}",
    }


def _plant(cfg: dict, place: str, text: str) -> tuple[dict, list[str]]:
    """``text`` put into the config (or a tensor name) at ``place``; the extra arguments."""
    cfg = dict(cfg)
    if place == "model_type":  # LlamaForCausalLM is another family's: the model type is claimed
        cfg["model_type"] = text
    elif place == "architecture":
        cfg["architectures"] = [text]
        return cfg, ["--hf-class", "LlamaForCausalLM"]
    elif place == "field_name":
        cfg[text] = 1
    elif place == "field_value":
        cfg["extra_field"] = text
    elif place == "known_field_value":  # a field the scaffold knows, at a value it does not
        cfg["sliding_window"] = text
    elif place == "nested_value":
        cfg["extra_nested"] = {text: [text, {"k": text, "n": [1.5, None, True]}]}
        cfg["rope_scaling"] = {"rope_type": text, "factor": [text]}
    return cfg, []


PLACES = (
    "model_type",
    "architecture",
    "field_name",
    "field_value",
    "known_field_value",
    "nested_value",
    "tensor_name",
)
VARIANTS = tuple(_breakouts(Path("m")))
CASES = [(place, variant) for place in PLACES for variant in VARIANTS] + [
    (place, "benign") for place in PLACES
]


def _hf_with(base: Path, dst: Path, place: str, text: str) -> list[str]:
    """A copy of the tiny checkpoint ``base`` at ``dst`` with ``text`` planted at ``place``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, dst)
    cfg, extra = _plant(json.loads((base / "config.json").read_text()), place, text)
    (dst / "config.json").write_text(json.dumps(cfg))
    if place == "tensor_name":
        tensors = load_file(dst / "model.safetensors")
        tensors[text] = tensors["model.norm.weight"].clone()
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return extra


# Run in a child: imports every generated converter and test module, and reports what each
# family holds as JSON (hostile values included, so the parent compares them as data).
_IMPORT_ALL = r"""
import importlib, importlib.util, json, sys
from pathlib import Path

cases, report = json.loads(Path(sys.argv[1]).read_text()), {}
for case in cases:
    name, out = case["name"], Path(case["out"])
    sys.path.insert(0, str(out))
    try:
        conv = importlib.import_module(f"porting_family_{name}.converter")
        spec = importlib.util.spec_from_file_location(
            f"generated_test_{name}", out / "tests" / f"test_{name}.py"
        )
        test = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(test)
        cfg = json.loads((Path(case["hf"]) / "config.json").read_text())
        fam = conv.FAMILY
        entries = [e for e in fam.config_entries if hasattr(e, "hf")]
        report[case["id"]] = {
            "architectures": list(fam.architectures),
            "model_types": list(fam.model_types),
            "summary": fam.summary,
            "hf_model_class": fam.hf_model_class,
            "undecided": [[e.hf, e.seen] for e in entries if type(e).__name__ == "Undecided"],
            "required_accepts_own": all(
                e.ok(cfg[e.hf]) for e in entries if type(e).__name__ == "Require" and e.hf in cfg
            ),
            "tiny": test.TINY,
            "tensors": list(conv.TENSORS_TO_DECIDE),
            "architecture": test.ARCHITECTURE,
        }
    except BaseException as err:
        report[case["id"]] = {"error": f"{type(err).__name__}: {err}"}
Path(sys.argv[2]).write_text(json.dumps(report))
"""


def _shape(tree: ast.AST) -> collections.Counter:
    """The kinds of node in ``tree`` other than those a literal is made of: a value that became
    code (a call, a name, an assignment) adds some."""
    literal = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.UnaryOp, ast.USub, ast.Load)
    return collections.Counter(
        type(n).__name__ for n in ast.walk(tree) if not isinstance(n, literal)
    )


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Every case scaffolded (in this process, as the CLI runs it), then every generated package
    imported in one child; returns (root, per-case scaffold result, the child's report)."""
    root = tmp_path_factory.mktemp("hostile")
    base = make_llama(root / "base")
    marks = root / "marks"
    marks.mkdir()
    done, to_import = {}, []
    for i, (place, variant) in enumerate(CASES):
        case_id = f"{place}-{variant}"
        texts = _breakouts(marks / case_id) | {"benign": "benign"}
        text = texts[variant]
        if variant == "lone_surrogate":
            # not Unicode text: config.json refuses it on reading
            # (test_a_lone_surrogate_is_refused_on_reading), a safetensors header cannot hold it
            continue
        hf, out, name = root / f"hf{i}", root / f"out{i}", f"h{i}"
        extra = _hf_with(base, hf, place, text)
        rc, stdout, stderr = _scaffold(
            ["new-family", name, "--from", str(hf), "--out", str(out), *extra]
        )
        done[case_id] = dict(rc=rc, stdout=stdout, stderr=stderr, out=out, text=text, name=name)
        if rc == 0:
            to_import.append(dict(id=case_id, name=name, out=str(out), hf=str(hf)))
    cases, report = root / "cases.json", root / "report.json"
    cases.write_text(json.dumps(to_import))
    script = root / "import_all.py"
    script.write_text(_IMPORT_ALL)
    run = subprocess.run(
        [sys.executable, str(script), str(cases), str(report)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return root, done, json.loads(report.read_text())


def _scaffold(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` in this process, with what it printed."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_no_payload_ran(generated):
    root, done, report = generated
    assert list((root / "marks").iterdir()) == []
    assert len(report) == len(done)  # every case scaffolded and imported
    assert not {k: v["error"] for k, v in report.items() if "error" in v}


# A lone surrogate is never scaffolded (see `generated`).
_ARRIVING = [c for c in CASES if c[1] != "lone_surrogate"]


@pytest.mark.parametrize("place", [p for p in PLACES if p != "tensor_name"])
def test_a_lone_surrogate_is_refused_on_reading(tmp_path, place):
    base = make_llama(tmp_path / "base")
    hf, out = tmp_path / "hf", tmp_path / "out"
    extra = _hf_with(base, hf, place, "\ud800 x")
    rc, _, err = _scaffold(
        ["new-family", "surrogate", "--from", str(hf), "--out", str(out), *extra]
    )
    assert rc == 2 and "lone surrogate" in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("place,variant", _ARRIVING, ids=[f"{p}-{v}" for p, v in _ARRIVING])
def test_each_value_arrives_as_data(generated, place, variant):
    root, done, report = generated
    case = done[f"{place}-{variant}"]
    assert case["rc"] == 0, case["stderr"]
    assert case["stderr"] == ""
    # the terminal summary carries no control characters of the checkpoint's
    assert all(line.isprintable() for line in case["stdout"].splitlines()), case["stdout"]
    got, text = report[f"{place}-{variant}"], case["text"]
    out = case["out"]
    # what new-family wrote; the bytecode of its modules, written when the scaffold ran, is not
    sources = {
        p: p.read_text(encoding="utf-8")
        for p in out.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert all(s.isascii() for s in sources.values())
    undecided = {k: v for k, v in got["undecided"]}
    assert got["required_accepts_own"]
    if place == "model_type":
        assert got["model_types"] == [text] and got["architectures"] == []
        assert text in got["summary"]
    elif place == "architecture":
        assert got["architectures"] == [text] and got["model_types"] == []
        assert got["hf_model_class"] == got["architecture"] == "LlamaForCausalLM"
    elif place == "field_name":
        assert undecided[text] == 1 and got["tiny"][text] == 1
    elif place == "field_value":
        assert undecided["extra_field"] == text == got["tiny"]["extra_field"]
    elif place == "known_field_value":
        assert undecided["sliding_window"] == text == got["tiny"]["sliding_window"]
    elif place == "nested_value":
        planted, _ = _plant({}, place, text)
        assert undecided["extra_nested"] == planted["extra_nested"] == got["tiny"]["extra_nested"]
        assert got["tiny"]["rope_scaling"] == planted["rope_scaling"]
    elif place == "tensor_name":
        # a tensor no table reads: listed to decide, as data, and Undecided until it is
        assert text in got["tensors"]
        assert undecided[text] == "an HF tensor no entry of WEIGHTS reads"


@pytest.mark.parametrize("place", PLACES)
def test_hostile_modules_have_the_benign_modules_code(generated, place):
    """Independent of the scaffold's own check: each generated module has the kinds of node of
    the one generated from a benign value at the same place, literals aside."""
    _, done, _ = generated
    benign = done[f"{place}-benign"]
    for variant in VARIANTS:
        case = done.get(f"{place}-{variant}")
        if case is None:
            continue
        for path in sorted(benign["out"].rglob("*.py")):
            rel = str(path.relative_to(benign["out"])).replace(benign["name"], case["name"])
            got = ast.parse((case["out"] / rel).read_text())
            assert _shape(got) == _shape(ast.parse(path.read_text())), (variant, rel)


@pytest.mark.parametrize(
    "value,needle",
    [
        (float("nan"), "NaN"),
        (json.loads("[" * 40 + "]" * 40), "nested deeper than"),
        (json.loads("[" * 300 + "]" * 300), "nested deeper than"),
    ],
    ids=["nan", "nested_40", "nested_300"],
)
def test_values_without_a_literal_are_refused_by_name(value, needle, tmp_path, capsys):
    base = make_llama(tmp_path / "base")
    cfg = json.loads((base / "config.json").read_text())
    cfg["odd\nfield"] = value
    (base / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "p"
    assert main(["new-family", "odd", "--from", str(base), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
    with pytest.raises(ValueError, match=needle):
        scaffold._literal(value)


def test_infinities_are_carried_as_numbers(tmp_path, capsys):
    base = make_llama(tmp_path / "base")
    cfg = json.loads((base / "config.json").read_text())
    cfg["extra_limits"] = [float("inf"), float("-inf"), -0.0, 1e308, 2**80]
    (base / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "p"
    assert main(["new-family", "limits", "--from", str(base), "--out", str(out)]) == 0
    text = (out / "porting_family_limits" / "converter.py").read_text()
    assert (
        "Undecided('extra_limits', [1e999, -1e999, -0.0, 1e+308, 1208925819614629174706176])"
        in text
    )


@pytest.mark.parametrize(
    "field,value",
    [("num_hidden_layers", 10**9), ("num_local_experts", 10**9), ("num_hidden_layers", "3")],
)
def test_a_model_too_large_or_odd_to_build_is_read_from_the_checkpoint(
    field, value, tmp_path, capsys
):
    """The HF model is built on the meta device only up to a bound on its modules (and not where
    transformers cannot build the config): past it, the tensor names are the checkpoint's, and
    the summary says so."""
    base = make_llama(tmp_path / "base")
    cfg = json.loads((base / "config.json").read_text())
    cfg[field] = value
    (base / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "p"
    assert main(["new-family", "big", "--from", str(base), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "HF tensor names from: the checkpoint alone (" in said, said


def test_a_model_type_that_is_not_a_string_is_refused(tmp_path, capsys):
    base = make_llama(tmp_path / "base")
    cfg = json.loads((base / "config.json").read_text())
    cfg["model_type"] = ["llama"]
    (base / "config.json").write_text(json.dumps(cfg))
    assert main(["new-family", "odd", "--from", str(base), "--out", str(tmp_path / "p")]) == 2
    assert "model_type must be a string" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_a_leaked_value_is_caught_by_the_parse_back(tmp_path, capsys, monkeypatch):
    """The second line of defence: were the writer to let a value through as code, the module
    parsed back no longer matches its template and nothing is written."""
    base = make_llama(tmp_path / "base")
    cfg = json.loads((base / "config.json").read_text())
    mark = tmp_path / "mark"
    cfg["model_type"] = f"x', __import__('pathlib').Path({str(mark)!r}).touch(), '"
    (base / "config.json").write_text(json.dumps(cfg))
    real = scaffold._Values.__call__
    monkeypatch.setattr(
        scaffold._Values,
        "__call__",
        lambda self, v: (
            "'" + v + "'" if isinstance(v, str) and not self.placeholders else real(self, v)
        ),
    )
    assert main(["new-family", "leak", "--from", str(base), "--out", str(tmp_path / "p")]) == 2
    assert "is not its template" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
    assert not mark.exists()


BAD_NAMES = [
    "",
    "Bad",
    "1abc",
    "a-b",
    "a/b",
    "../x",
    "a..b",
    "a.b",
    "a b",
    "a\nb",
    "a\x00b",
    "_x",
    "é",
    "ａ",  # fullwidth: an identifier to Python, not to us
    "class",
    "None",
    "lambda",
    "async",
    "x" * 65,
    "x" * 300,
    "x" * 5000,
    "{name}",
    "a'b",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[f"name{i}" for i in range(len(BAD_NAMES))])
def test_bad_names_exit_2_with_one_line_and_make_nothing(name, tmp_path, monkeypatch):
    base = make_llama(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    for out in ([], ["--out", str(tmp_path / "p")]):
        rc, stdout, stderr = _scaffold(["new-family", name, "--from", str(base), *out])
        assert rc == 2, stderr
        assert (
            stderr.startswith("porting new-family: error: family name ") and stderr.count("\n") == 1
        ), stderr
        assert len(stderr) < 400 and stderr.isascii()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_the_longest_name_is_written(tmp_path):
    base = make_llama(tmp_path / "hf")
    name = "x" * scaffold.NAME_MAX
    assert main(["new-family", name, "--from", str(base), "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / f"porting_family_{name}" / "converter.py").is_file()


def test_a_name_whose_package_is_importable_is_refused(tmp_path, monkeypatch, capsys):
    base = make_llama(tmp_path / "hf")
    site = tmp_path / "site"
    (site / "porting_family_clash").mkdir(parents=True)
    (site / "porting_family_clash" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    assert main(["new-family", "clash", "--from", str(base), "--out", str(tmp_path / "p")]) == 2
    assert "porting_family_clash is already importable" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def _snapshot(root: Path) -> dict[str, bytes | str]:
    return {
        str(p.relative_to(root)): (os.readlink(p) if p.is_symlink() else p.read_bytes())
        if not p.is_dir() or p.is_symlink()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize(
    "where,needle",
    [
        ("hf", "is the HF directory"),
        ("hf/sub", "lies inside the HF directory"),
        ("hf/../hf", "is the HF directory"),
        (".", "contains the HF directory"),
        ("link", "is the HF directory"),
        ("link/deeper", "lies inside the HF directory"),
    ],
)
def test_an_out_overlapping_the_input_is_refused_even_with_overwrite(
    where, needle, tmp_path, monkeypatch
):
    hf = make_llama(tmp_path / "hf")
    (tmp_path / "link").symlink_to(hf)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    for flags in ([], ["--overwrite"]):
        rc, _, stderr = _scaffold(["new-family", "over", "--from", "hf", "--out", where, *flags])
        assert rc == 2 and needle in stderr and stderr.count("\n") == 1, stderr
        assert "--out" in stderr
        assert _snapshot(tmp_path) == before


def test_the_default_out_inside_the_input_is_refused(tmp_path, monkeypatch):
    hf = make_llama(tmp_path / "hf")
    monkeypatch.chdir(hf)
    before = _snapshot(tmp_path)
    rc, _, stderr = _scaffold(["new-family", "inside", "--from", "."])
    assert rc == 2 and "lies inside the HF directory" in stderr, stderr
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["file", "symlink_to_dir", "dangling_symlink"])
def test_an_out_that_is_not_a_directory_is_kept(kind, tmp_path):
    hf = make_llama(tmp_path / "hf")
    out, other = tmp_path / "p", tmp_path / "other"
    other.mkdir()
    (other / "mine").write_text("keep")
    if kind == "file":
        out.write_text("keep")
    elif kind == "symlink_to_dir":
        out.symlink_to(other)
    else:
        out.symlink_to(tmp_path / "nowhere")
    before = _snapshot(tmp_path)
    rc, _, stderr = _scaffold(
        ["new-family", "keep", "--from", str(hf), "--out", str(out), "--overwrite"]
    )
    assert rc == 2 and "not a directory" in stderr and stderr.count("\n") == 1, stderr
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("how", ["name_too_long", "parent_is_a_file"])
def test_an_out_that_cannot_be_made_exits_2_leaving_nothing(how, tmp_path):
    hf = make_llama(tmp_path / "hf")
    if how == "name_too_long":
        out = tmp_path / ("p" * 300)
    else:
        (tmp_path / "f").write_text("keep")
        out = tmp_path / "f" / "p"
    before = _snapshot(tmp_path)
    rc, _, stderr = _scaffold(["new-family", "unmade", "--from", str(hf), "--out", str(out)])
    assert rc == 2 and "cannot write" in stderr and stderr.count("\n") == 1, stderr
    assert _snapshot(tmp_path) == before


def test_overwrite_replaces_an_earlier_scaffold_and_leaves_nothing_beside_it(tmp_path):
    hf = make_llama(tmp_path / "hf")
    out = tmp_path / "p"
    assert main(["new-family", "again", "--from", str(hf), "--out", str(out)]) == 0
    (out / "stale").write_text("from before")
    assert main(["new-family", "again", "--from", str(hf), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "stale").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "p"]


@pytest.mark.parametrize("hf_class", ["__class__", "os.system", "LlamaConfig", "Llama\nx", ""])
def test_an_hf_class_that_is_no_transformers_model_is_refused(hf_class, tmp_path, capsys):
    hf = make_llama(tmp_path / "hf")
    argv = ["new-family", "cls", "--from", str(hf), "--out", str(tmp_path / "p")]
    assert main([*argv, "--hf-class", hf_class]) == 2
    err = capsys.readouterr().err
    assert "--hf-class" in err and err.count("\n") == 1, err
    assert not (tmp_path / "p").exists()
