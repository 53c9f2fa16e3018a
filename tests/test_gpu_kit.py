"""scripts/gpu/wheelhouse.py: its lists parse, its choices follow our pins, its stubs stay stubs.

The wheelhouse carries to the lent GPU machine what `porting` imports and the image lacks. These
tests need no network and no GPU: they read the committed lists, this environment's metadata and
the recipe's pure functions.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"


def _load(name: str, path: Path):
    # By path: NeMo installs a top-level package named `scripts`, so ours cannot be imported by name.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def wh():
    return _load("gpu_wheelhouse", GPU / "wheelhouse.py")


@pytest.fixture(scope="module")
def needed(wh):
    return wh.read_needed()


@pytest.fixture(scope="module")
def image(wh):
    return wh.read_image()


@pytest.fixture(scope="module")
def here(wh, needed):
    """needed.txt at this environment's versions, as `build` takes it (the index moves daily)."""
    return wh.as_installed(needed)[0]


@pytest.fixture(scope="module")
def decisions(wh, here, image):
    return wh.select(here, image, wh.collect_pins(set(here), "3.12"))


def _project_pins(wh) -> dict[str, Requirement]:
    """pyproject.toml's pins for the kit's stack; a name pinned twice (megatron-core, in the
    package and in the nemo2 extra) keeps its tighter, later pin."""
    return {canonicalize_name(r.name): r for r in wh.project_requirements()}


def test_needed_lists_the_stack_and_not_the_repo(needed):
    assert {"nemo-toolkit", "megatron-core", "transformers", "tokenizers", "torch"} <= set(needed)
    assert "porting" not in needed
    assert all(item.commands for item in needed.values())
    assert "import" in needed["nemo-toolkit"].commands
    assert "plan" in needed["pyyaml"].commands


def test_needed_versions_meet_pyproject_pins(wh, needed):
    pins = _project_pins(wh)
    for name, item in needed.items():
        if name in pins:
            assert pins[name].specifier.contains(item.version, prereleases=True), (name, item)


def test_image_list_parses_with_known_versions(wh, image):
    assert len(image) > 150
    assert image["torch"] == "2.11.0" and image["numpy"] == "2.5.2"
    assert image["transformers"] == "5.17.0" and image["pyarrow"] is None
    text = (GPU / "image-packages.txt").read_text().splitlines()
    names = [ln.split("==")[0] for ln in text if ln and not ln.startswith("#")]
    assert names == [canonicalize_name(n) for n in names], "names are written normalised"


def test_image_list_reads_pip_freeze_output(wh, tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.11.0+cu130\nNumPy==2.5.2\n# comment\nhuggingface_hub==1.33.0\n")
    assert wh.read_image(freeze) == {
        "torch": "2.11.0",
        "numpy": "2.5.2",
        "huggingface-hub": "1.33.0",
    }


@pytest.mark.parametrize(
    "ours, image, in_image, spec, project, carry",
    [
        ("0.15.3", None, False, "", "==0.15.3", True),  # the image lacks it
        ("4.57.6", "5.17.0", True, "~=4.57", "~=4.57", True),  # incompatible: carry ours
        ("1.15.0", "1.15.0", True, ">=0.21.0", "", False),  # compatible: the image's
        ("2.21.0", None, True, "<3,>=2.13", "", False),  # unknown, a loose cap
        ("5.29.6", None, True, "~=5.29.5", "~=5.29.5", True),  # unknown, pinned
        ("24.2", None, True, "<25,>=20", "<25", True),  # unknown, pyproject caps it
        ("1.26.20", None, True, "<1.27", "", True),  # unknown, capped below our next minor
    ],
)
def test_decide(wh, ours, image, in_image, spec, project, carry):
    dec = wh.decide(ours, image, in_image, SpecifierSet(spec), SpecifierSet(project))
    assert dec.carry is carry, dec.reason


def test_selection_carries_our_pinned_stack_and_never_torch(wh, decisions, here):
    carried = {n for n, d in decisions.items() if d.carry}
    assert {"transformers", "tokenizers", "huggingface-hub", "nemo-toolkit"} <= carried
    assert {"protobuf", "packaging", "fsspec", "lightning"} <= carried  # pins the image misses
    assert not {"torch", "numpy", "pyarrow", "wandb", "accelerate"} & carried
    pins = _project_pins(wh)
    for name in carried & set(pins):
        assert pins[name].specifier.contains(here[name].version, prereleases=True), name


def test_build_takes_this_environments_versions_and_names_what_moved(wh):
    recorded = {
        "packaging": wh.Needed("packaging", "0.1", ("import",)),
        "pytest": wh.Needed("pytest", md.version("pytest"), ("train",)),
    }
    here, moved = wh.as_installed(recorded)
    assert here["packaging"] == wh.Needed("packaging", md.version("packaging"), ("import",))
    assert moved == [f"packaging 0.1 -> {md.version('packaging')}"]
    recorded["no-such-dist"] = wh.Needed("no-such-dist", "1.0", ("train",))
    with pytest.raises(SystemExit, match="no-such-dist, which this environment lacks.*trace"):
        wh.as_installed(recorded)


def test_tables_name_needed_distributions_only(wh, needed, image):
    for table in (wh.LEFT_BEHIND, wh.STUBBED, wh.USE_IMAGE_ANYWAY, wh.CARRY_ANYWAY):
        assert set(table) <= set(needed), set(table) - set(needed)
    assert not set(wh.LEFT_BEHIND) & set(image), "a left-behind import would find the image's"
    assert set(wh.USE_IMAGE_ANYWAY) <= set(image)


def test_stub_projects_match_the_table_and_needed_versions(wh, needed):
    for name in wh.STUBBED:
        project = tomllib.loads((GPU / "stubs" / name / "pyproject.toml").read_text())["project"]
        assert canonicalize_name(project["name"]) == name
        assert project["version"] == f"{needed[name].version}+stub"


def test_stubs_import_and_refuse_use():
    onnx = _load("stub_onnx", GPU / "stubs" / "onnx" / "onnx" / "__init__.py")
    with pytest.raises(AttributeError, match="stand-in"):
        _ = onnx.load
    pulp = _load("stub_pulp", GPU / "stubs" / "pulp" / "pulp" / "__init__.py")
    assert list[pulp.LpVariable]  # modelopt's annotations evaluate at import
    with pytest.raises(RuntimeError, match="stand-in"):
        pulp.LpProblem(name="x")


def test_import_profile_parsing_and_module_owners(wh):
    err = "import time: self [us] | cumulative | imported package\nimport time: 5 | 9 |   a.b\n"
    assert wh.imported_modules(err) == {"a.b"}
    assert wh._module_of_file("google/protobuf/message.py") == "google.protobuf.message"
    assert wh._module_of_file("yaml/_yaml.cpython-311-x86_64-linux-gnu.so") == "yaml._yaml"
    assert wh._module_of_file("numpy-1.26.4.dist-info/RECORD") is None
    owners = {"google.protobuf": "protobuf", "google.api_core": "google-api-core"}
    top = {"google": ["protobuf", "google-api-core"], "porting": ["porting"]}
    assert wh.owner_of("google.protobuf.internal.x", owners, top) == "protobuf"
    assert wh.owner_of("google", owners, top) is None  # a namespace shared by two
    assert wh.owner_of("porting.cli", owners, top) == "porting"
