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
    names = _family_modules() if mod == "porting.registry" else []
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
    edges["porting.convert.mapping"].add("porting.family")
    assert ["porting.convert.mapping", "porting.family"] in _cycles(edges)


def _imports_of(prefix: str) -> set[str]:
    return {t for m, ts in EDGES.items() if m == prefix or m.startswith(prefix + ".") for t in ts}


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
    for pkg in ("porting.convert", "porting.parity", "porting.train", "porting.planner"):
        doc = ast.get_docstring(ast.parse(_modules()[pkg].read_text()))
        assert doc and "import" in doc, f"{pkg}/__init__.py must say what it may import"


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
        "import porting.planner.cli, porting.planner.emit, porting.planner.plot, "
        "porting.planner.calibrate",
    ],
    ids=["import porting", "porting --help", "porting plan --help", "planner modules"],
)
def test_light_entry_points_load_no_torch_or_nemo(code):
    assert _loaded_after(code) & set(HEAVY) == set()
