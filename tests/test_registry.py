"""The registry finds families through the ``porting.families`` entry points, ours included.

Outside packages are simulated as real installed distributions: a ``*.dist-info`` directory with
``METADATA`` and ``entry_points.txt`` on ``sys.path``, which is what ``importlib.metadata`` (and
so the registry) reads for a package installed by pip.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from porting.cli import main
from porting.contract import registry
from porting.errors import PortingError

ROOT = Path(__file__).resolve().parents[1]


def test_our_families_are_registered_as_entry_points_exactly_as_pyproject_says():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][
        "porting.families"
    ]
    ours = {i.name: i.value for i in registry.installed() if i.package.startswith("porting ")}
    assert ours == declared
    assert {"tsuzumi", "falcon"} <= set(ours)


def test_each_family_answers_to_its_keys_and_only_to_them():
    for fam in registry.families():
        assert fam.keys, fam.name
        for arch in fam.architectures:
            assert registry.family_for_config({"architectures": [arch]}) is fam
        for mtype in fam.model_types:
            cfg = {"architectures": ["SomethingNobodyClaims"], "model_type": mtype}
            assert registry.family_for_config(cfg) is fam
        assert registry.family_by_name(fam.name) is fam


def test_unknown_architecture_names_the_known_ones_and_the_guide():
    with pytest.raises(PortingError) as err:
        registry.family_for_config({"architectures": ["NoSuchForCausalLM"], "model_type": "x"})
    msg = str(err.value)
    for needle in ("NoSuchForCausalLM", "LlamaForCausalLM", "docs/families.md", "new-family"):
        assert needle in msg, msg


@pytest.mark.parametrize("arch", sorted(registry.OUT_OF_SCOPE))
def test_a_hybrid_state_space_model_is_refused_by_name_with_why(arch):
    with pytest.raises(PortingError) as err:
        registry.family_for_config({"architectures": [arch], "model_type": "x"})
    msg = str(err.value)
    for needle in (arch, "is not supported", "kernels", "Hybrid state-space models"):
        assert needle in msg, msg


def test_an_installed_family_that_claims_a_hybrid_architecture_wins(monkeypatch):
    import dataclasses

    from converters import llama

    plugin = dataclasses.replace(llama.FAMILY, architectures=("NemotronHForCausalLM",))
    monkeypatch.setattr(registry, "families", lambda: [plugin])
    assert registry.family_for_config({"architectures": ["NemotronHForCausalLM"]}) is plugin


def _install(site: Path, dist: str, families: dict[str, str], module_source: str) -> None:
    """A distribution ``dist`` whose entry points name ``families`` (name -> module:attr)."""
    # pip's directory naming: the name's dashes as underscores (importlib.metadata parses it)
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{k} = {v}" for k, v in families.items())
    (info / "entry_points.txt").write_text(f"[porting.families]\n{lines}\n")
    module = next(iter(families.values())).partition(":")[0]
    (site / f"{module}.py").write_text(textwrap.dedent(module_source))
    (site / f"{module}_nemo.py").write_text(_MODEL_SRC)


# A family's NeMo model class in a module of its own: only training imports it (and NeMo).
_MODEL_SRC = """from models.llama_nemo import LlamaModel


class M(LlamaModel):
    pass
"""


# A family over the Llama tables with its own model class and its own key.
_FAMILY_SRC = """
    import dataclasses
    from converters import llama

    FAMILY = dataclasses.replace(
        llama.FAMILY, name={name!r}, architectures={archs!r}, model_types={mtypes!r},
        model_cls=__name__ + "_nemo:M",
    )
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on ``sys.path`` to install fake distributions into; the registry is reset."""
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.refresh()
    yield tmp_path
    for mod in [m for m in sys.modules if m.startswith("fam_")]:
        del sys.modules[mod]
    monkeypatch.undo()
    registry.refresh()


def test_an_installed_outside_family_is_found_by_model_type(site):
    src = _FAMILY_SRC.format(name="inhouse", archs=("InHouseForCausalLM",), mtypes=("ih",))
    _install(site, "inhouse-family", {"inhouse": "fam_inhouse:FAMILY"}, src)
    registry.refresh()
    fam = registry.family_for_config({"architectures": ["AutoMapOnlyName"], "model_type": "ih"})
    assert fam.name == "inhouse"
    (inst,) = [i for i in registry.installed() if i.name == "inhouse"]
    assert inst.package == "inhouse-family 1.0" and inst.error is None


def test_two_families_claiming_one_key_is_an_error_naming_both_packages(site):
    for dist, name in (("pkg-one", "one"), ("pkg-two", "two")):
        src = _FAMILY_SRC.format(name=name, archs=("SharedForCausalLM",), mtypes=())
        _install(site, dist, {name: f"fam_{name}:FAMILY"}, src)
    registry.refresh()
    with pytest.raises(PortingError) as err:
        registry.families()
    msg = str(err.value)
    for needle in ("SharedForCausalLM", "pkg-one 1.0", "pkg-two 1.0", "one", "two"):
        assert needle in msg, msg


def test_a_family_taking_our_architecture_is_refused(site):
    src = _FAMILY_SRC.format(name="llama2", archs=("LlamaForCausalLM",), mtypes=())
    _install(site, "squatter", {"llama2": "fam_llama2:FAMILY"}, src)
    registry.refresh()
    with pytest.raises(PortingError, match=r"LlamaForCausalLM.*claimed by two families"):
        registry.family_for_config({"architectures": ["LlamaForCausalLM"]})


def test_two_families_sharing_a_model_class_are_refused(site):
    src = """
        import dataclasses
        from converters import llama
        FAMILY = dataclasses.replace(llama.FAMILY, name="twin", architectures=("TwinLM",))
    """
    _install(site, "twin", {"twin": "fam_twin:FAMILY"}, src)
    registry.refresh()
    with pytest.raises(PortingError, match="share the model class LlamaModel"):
        registry.families()


def test_a_broken_family_is_listed_with_its_error_and_the_rest_still_work(site, capsys):
    _install(site, "broken", {"broken": "fam_broken:FAMILY"}, "raise ImportError('no such dep')\n")
    _install(site, "notafamily", {"nota": "fam_nota:FAMILY"}, "FAMILY = 3\n")
    registry.refresh()
    assert registry.family_by_name("tsuzumi").name == "tsuzumi"
    with pytest.raises(PortingError, match=r"broken \(fam_broken:FAMILY: ImportError: no such dep"):
        registry.family_by_name("missing")
    assert main(["families", "--json"]) == 2
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "ImportError: no such dep" in rows["broken"]["error"]
    assert "is a int, not a Family" in rows["nota"]["error"]
    assert rows["llama"]["architectures"] == ["LlamaForCausalLM"]
    assert rows["falcon"]["variants"]["rw_alibi_biases"]


def test_an_entry_named_apart_from_its_family_is_refused(site):
    src = _FAMILY_SRC.format(name="realname", archs=("X1",), mtypes=())
    _install(site, "misnamed", {"othername": "fam_misnamed:FAMILY"}, src)
    registry.refresh()
    (inst,) = [i for i in registry.installed() if i.name == "othername"]
    assert "must be the family's" in inst.error


def test_families_lists_ours_with_their_source_files(capsys):
    assert main(["families"]) == 0
    out = capsys.readouterr().out
    assert "llama  (porting 0.1.0, converters.llama:FAMILY)" in out
    assert str(ROOT / "converters" / "falcon.py") in out
    assert "claims: FalconForCausalLM" in out
    assert "and the language model of: Gemma3ForConditionalGeneration" in out
    main(["families", "--json"])
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["mistral"]["containers"] == ["Mistral3ForConditionalGeneration"]
    assert rows["llama"]["containers"] == []


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """``porting families | head -1``: the exit status of a command stopped by SIGPIPE, and no
    traceback (from the write, or from the flush at exit)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "porting.cli", "families"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    proc.stdout.close()  # gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait() == 141
    assert err == ""


def test_a_broken_pipe_that_is_not_stdout_is_a_failure(monkeypatch):
    """Only stdout's closed reader ends a command quietly; a worker's or a child's broken pipe
    is an error like any other."""

    def broken():
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(registry, "installed", broken)
    with pytest.raises(BrokenPipeError):
        main(["families"])


def test_import_family_flag_must_claim_the_checkpoint(tmp_path, capsys):
    from porting.testing import make_llama

    hf = make_llama(tmp_path / "hf")
    code = main(["import", str(hf), "--out", str(tmp_path / "o"), "--family", "falcon"])
    err = capsys.readouterr().err
    assert code == 2 and "family falcon claims FalconForCausalLM" in err, err
    assert "LlamaForCausalLM" in err
    code = main(["import", str(hf), "--out", str(tmp_path / "o"), "--family", "nope"])
    assert code == 2 and "no family called 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# An outside family whose config spells its shape in its own words: the planner asks the family.
_PLANNED_SRC = """
    import dataclasses
    from converters import llama


    def plan_shape(cfg, source, read):
        hidden = read.need(cfg, source, "hidden", "d_model")
        return read.llama_layout(
            {
                "hidden_size": hidden, "num_hidden_layers": cfg["n_layers"],
                "num_attention_heads": cfg["n_heads"], "num_key_value_heads": cfg["n_kv"],
                "intermediate_size": cfg["d_ff"], "vocab_size": cfg["vocab_size"],
            },
            source,
        )


    FAMILY = dataclasses.replace(
        llama.FAMILY, name="inhouse", architectures=("InHouseForCausalLM",), model_types=(),
        model_cls=__name__ + "_nemo:M", plan_shape=plan_shape,
    )
"""


def test_an_outside_family_is_planned_by_its_own_reading_with_no_planner_edit(
    site, tmp_path, capsys
):
    """``Family.plan_shape``: the planner reads no family's rules; a config in an outside
    family's own words is refused until that family is installed, then planned from its
    reading, end to end through ``porting plan``."""
    from porting.planner.model import load_model

    cfg = {"architectures": ["InHouseForCausalLM"], "d_model": 512, "n_layers": 4,
           "n_heads": 8, "n_kv": 2, "d_ff": 1408, "vocab_size": 32000}  # fmt: skip
    path = tmp_path / "inhouse" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    with pytest.raises(PortingError, match="missing field hidden_size"):
        load_model(path)
    _install(site, "inhouse-family", {"inhouse": "fam_inhouse:FAMILY"}, _PLANNED_SRC)
    registry.refresh()
    shape = load_model(path)
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn, shape.vocab) == (
        512, 4, 8, 2, 1408, 32000,
    )  # fmt: skip
    argv = ["plan", "--model", str(path), "--cluster", "examples/clusters/dgx-h100-one-site.yaml",
            "--global-batch", "64", "--seq-length", "1024", "--json"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["step_s"] > 0


def test_a_plan_shape_that_answers_wrongly_is_named(site, tmp_path):
    """A plugin's reading that names a field the planner's shape lacks is the plugin's error."""
    src = _PLANNED_SRC.replace(
        "return read.llama_layout(", "return {'wings': 2} | read.llama_layout("
    )
    _install(site, "inhouse-family", {"inhouse": "fam_inhouse:FAMILY"}, src)
    registry.refresh()
    from porting.planner.model import from_hf_config

    cfg = {"architectures": ["InHouseForCausalLM"], "d_model": 512, "n_layers": 4,
           "n_heads": 8, "n_kv": 2, "d_ff": 1408, "vocab_size": 32000}  # fmt: skip
    with pytest.raises(
        PortingError, match=r"family inhouse's plan_shape \(.*fam_inhouse.py\).*wings"
    ):
        from_hf_config(cfg)
