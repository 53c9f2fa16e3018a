"""The layout's rules, pinned: what each capability may import, and no import circles anywhere.

The import graph is read from the source (every ``import`` statement, at module level or inside a
function, plus the modules the registry's entry points and the CLI name), so a lazy import cannot hide
a dependency. ``porting --help`` and the planner are also run to check what they really load.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUR_PACKAGES = ("porting", "models", "converters", "data_prep")
HEAVY = ("torch", "nemo", "megatron", "transformers", "lightning")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in OUR_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that ``import name`` loads (a name inside a module counts as the module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _family_modules() -> list[str]:
    """The modules our ``porting.families`` entry points name (the registry loads them)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    eps = project["entry-points"]["porting.families"]
    return [value.partition(":")[0] for value in eps.values()]


def _string_imports(mod: str, tree: ast.Module) -> list[str]:
    """Modules imported by name: the registry's entry points and the CLI's subcommand modules."""
    names = _family_modules() if mod == "porting.contract.registry" else []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id == "_SUBCOMMAND_MODULES":
                for const in ast.walk(node.value):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        names.append(const.value)
    return names


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, third-party top-level names each module imports)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    third: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        names: list[str] = _string_imports(mod, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    raise AssertionError(f"{path}: relative import; the layout uses absolute ones")
                names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != mod:
                edges[mod].add(target)
            elif target is None:
                third[mod].add(name.partition(".")[0])
    return edges, third


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


EDGES, THIRD = _graph()


def test_no_import_circles():
    assert _cycles(EDGES) == []


def test_cycle_finder_finds_a_planted_circle():
    edges = {k: set(v) for k, v in EDGES.items()}
    edges["porting.contract.mapping"].add("porting.contract.family")
    assert ["porting.contract.family", "porting.contract.mapping"] in _cycles(edges)


def _imports_of(prefix: str) -> set[str]:
    return {t for m, ts in EDGES.items() if m == prefix or m.startswith(prefix + ".") for t in ts}


# The layers, bottom to top (docs/architecture.md). A module imports from its own layer or below:
# an import of a higher layer is an up-arrow. Every module is named here, itself or by the package
# it lies in (a package name covers its modules; ``porting`` is only the package root, so a new
# ``porting.x`` must be placed): one that is not fails the test. The registry's entry points are
# not arrows: it finds plugins by name at run time, ours exactly as an outside package's.
LAYERS = (
    (
        "core",
        (
            "porting",
            "porting.errors",
            "porting.cache",
            "porting.guard",
            "porting.quiet",
            "porting.shell",
            "porting.handoff",
            "porting.slurm",
            "porting.launch",
            "porting.untrusted",
            "porting.pages",
        ),
    ),  # fmt: skip
    ("contract", ("porting.contract", "porting.planner")),
    ("megatron side", ("models", "porting.cpu", "porting.mcore", "porting.nemo_classes")),
    ("families", ("converters",)),
    ("engine", ("porting.convert", "porting.owners", "data_prep")),
    ("gate", ("porting.parity",)),
    ("workflows", ("porting.api", "porting.train", "porting.scaffold", "porting.testing")),
    ("commands", ("porting.cli", "porting.commands")),
    ("proof kit", ("porting.proof",)),
)
# names that cover only themselves, not the modules below them
EXACT = ("porting",)


def _layer(module: str, layers=LAYERS) -> int:
    def covers(prefix: str) -> bool:
        if prefix in EXACT:
            return module == prefix
        return module == prefix or module.startswith(prefix + ".")

    best = max(
        ((len(p), i) for i, (_, ps) in enumerate(layers) for p in ps if covers(p)),
        default=None,
    )
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best[1]


def _up_arrows(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    plugins = set(_family_modules())
    return sorted(
        (m, t)
        for m, ts in edges.items()
        for t in ts
        if not (m == "porting.contract.registry" and t in plugins) and _layer(t) > _layer(m)
    )


def test_every_module_is_in_a_layer():
    for module in EDGES:
        _layer(module)


def test_a_module_in_no_layer_is_named():
    """A new top-level module (``porting.x``) or package is not covered by ``porting``."""
    for planted in ("porting.newthing", "porting.newpkg.mod", "newtoplevel.mod"):
        with pytest.raises(AssertionError, match=f"{planted} is in no layer"):
            _layer(planted)


def test_commands_live_in_one_room_and_nothing_below_imports_them():
    commands = {m for m in EDGES if _layer(m) == _layer("porting.cli")}
    assert commands == {"porting.cli"} | _within(set(EDGES), "porting.commands")
    assert not [m for m in EDGES if m.endswith(".cli") and m != "porting.cli"]
    for module, targets in EDGES.items():
        if _layer(module) < _layer("porting.cli"):
            assert not _within(targets, "porting.commands", "porting.cli"), module


def test_no_up_arrows():
    assert _up_arrows(EDGES) == []


def test_the_up_arrow_finder_finds_a_planted_one():
    edges = {k: set(v) for k, v in EDGES.items()}
    edges["porting.contract.family"].add("porting.convert.checkpoint")
    assert _up_arrows(edges) == [("porting.contract.family", "porting.convert.checkpoint")]


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported when the module loads (not inside functions, not for typing)."""
    names: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name.partition(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module.partition(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return names


def test_the_contract_imports_only_the_core_and_no_heavy_library():
    contract = {m: p for m, p in _modules().items() if _within({m}, "porting.contract")}
    for module, path in contract.items():
        ours = {t for t in EDGES[module] if not _within({t}, "porting.contract")}
        plugins = set(_family_modules()) if module == "porting.contract.registry" else set()
        core = {"porting", "porting.errors", "porting.guard", "porting.pages"}
        assert ours - plugins <= core, (module, ours)
        assert _module_level_imports(path) & set(HEAVY) == set(), module


def test_listing_the_families_and_refusing_a_config_load_no_heavy_library():
    code = (
        "from porting.contract import registry, config_map\n"
        "from porting.errors import PortingError\n"
        "fams = registry.families()\n"
        "assert {'llama', 'tsuzumi', 'falcon', 'gemma', 'qwen', 'mistral', 'moe'} <= "
        "{f.name for f in fams}\n"
        "for bad in ({'architectures': ['NoSuchLM']}, {'architectures': ['LlamaForCausalLM'], "
        "'model_type': 'llama', 'hidden_size': 0}):\n"
        "    try:\n"
        "        fam = registry.family_for_config(bad)\n"
        "        config_map.to_mcore(bad, fam.config_entries)\n"
        "    except PortingError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('not refused')"
    )
    assert _loaded_after(code) & set(HEAVY) == set()


def _within(names: set[str], *prefixes: str) -> set[str]:
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)}


@pytest.mark.parametrize(
    "package,forbidden",
    [
        ("porting.planner", ("porting.convert", "porting.parity", "porting.train", "models")),
        ("porting.convert", ("porting.train", "porting.planner")),
        ("porting.parity", ("porting.train", "porting.planner")),
        ("porting.train", ("porting.parity", "porting.planner")),
        ("models", ("converters", "porting.convert", "porting.parity", "porting.train")),
        ("data_prep", ("porting.convert", "porting.parity", "porting.train", "models")),
    ],
)
def test_capability_import_rules(package, forbidden):
    assert _within(_imports_of(package), *forbidden) == set()


def test_planner_imports_no_torch_or_nemo():
    heavy = {t for m, ts in THIRD.items() if m.startswith("porting.planner") for t in ts}
    assert heavy & set(HEAVY) == set()


def test_each_subpackage_says_what_it_is():
    for pkg in (
        "porting.contract",
        "porting.convert",
        "porting.parity",
        "porting.train",
        "porting.planner",
    ):
        doc = ast.get_docstring(ast.parse(_modules()[pkg].read_text()))
        assert doc and "import" in doc, f"{pkg}/__init__.py must say what it may import"


def test_the_proof_kit_says_what_it_offers():
    """Every public name of the proof kit (``porting.proof.__all__``) is made in one of its
    submodules, imported by the package, and documented in docs/families.md's "The proof kit"."""
    tree = ast.parse((ROOT / "porting/proof/__init__.py").read_text())
    public = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__"
    )
    imported = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("porting.proof.")
        for alias in node.names
    }
    page = (ROOT / "docs/families.md").read_text()
    kit = page[page.index("## The proof kit") : page.index("## What the engine gives for free")]
    assert public and set(public) == set(imported), set(public) ^ set(imported)
    assert [n for n in public if f"`{n}" not in kit] == []
    assert {m.rpartition(".")[2] for m in imported.values()} == {
        p.stem for p in (ROOT / "porting/proof").glob("*.py") if p.stem != "__init__"
    }


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.split()
    return {m.partition(".")[0] for m in out}


@pytest.mark.parametrize(
    "code",
    [
        "import porting",
        "from porting.cli import build_parser; build_parser().format_help()",
        "from porting.cli import main\ntry:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass",
        "import porting.commands.plan, porting.planner.emit, porting.planner.plot, "
        "porting.planner.calibrate",
        "from porting.cli import main\nassert main(['families']) == 0",
        "from porting.cli import main\nassert main(['import', '/no/such/dir', '--out', '/tmp/x']) == 2",
        "from porting.cli import main\nassert main(['export', '/no/such/ckpt', '--out', '/tmp/x']) == 2",
    ],
    ids=[
        "import porting",
        "porting --help",
        "porting plan --help",
        "planner modules",
        "porting families",
        "import refusing a missing directory",
        "export refusing a missing checkpoint",
    ],
)
def test_light_entry_points_load_no_torch_or_nemo(code):
    assert _loaded_after(code) & set(HEAVY) == set()
