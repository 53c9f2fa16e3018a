"""The one executor interface (porting/launch.py): every command that launches offers exactly its
table's executors, asks the object (never the name) what to do, and runs an executor added to
its table with no other edit. Function level: no process is started here (the real executors'
launches are proven in test_convert_ranks.py, test_slurm.py, test_train_multiproc.py,
test_train_stop.py, test_prep_ray.py and test_prep_slurm.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from porting.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _executor_action(parser, command: str):
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if a.dest == "executor")


def _tables():
    from data_prep.executors import EXECUTORS as PREP
    from porting.convert.executors import EXECUTORS as CONVERSION
    from porting.train.executors import EXECUTORS as TRAINING

    return {"import": CONVERSION, "export": CONVERSION, "verify": CONVERSION,
            "train": TRAINING, "prep-data": PREP}  # fmt: skip


def test_each_command_offers_exactly_its_tables_executors():
    parser = build_parser()
    for command, table in _tables().items():
        action = _executor_action(parser, command)
        assert action.choices == list(table), command
        assert action.default == "local"
        for executor in table.values():
            assert f"{executor.name}: {executor.help}" in action.help, (command, executor.name)


def test_the_executors_are_what_they_say():
    tables = _tables()
    for table in tables.values():
        assert not table["local"].starts_ranks and not table["local"].spans_nodes
        assert table["slurm"].starts_ranks and table["slurm"].spans_nodes
    for name in ("torchrun",):
        for command in ("import", "train"):
            e = tables[command][name]
            assert e.starts_ranks and not e.spans_nodes
            assert e.nodes(4) == 1 and tables[command]["slurm"].nodes(4) == 4
    assert tables["train"]["nemo-run"].engines == ("nemo2",)
    with pytest.raises(Exception, match="--executor nope: one of local, torchrun, slurm$"):
        tables["import"].get("nope")


def _name_comparisons(source: str) -> list[str]:
    """Every comparison of an ``executor`` (a name or an attribute) with a string."""

    def is_executor(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "executor") or (
            isinstance(node, ast.Attribute) and node.attr == "executor"
        )

    def names(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(map(names, node.elts))
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(is_executor, sides)) and any(map(names, sides)):
                found.append(ast.unparse(node))
    return found


def test_no_module_asks_an_executor_by_its_name():
    planted = 'if args.executor == "slurm":\n    pass\nok = cfg.executor != "local"\n'
    planted += 'many = executor in ("ray", "slurm")\n'
    assert _name_comparisons(planted) == [
        "args.executor == 'slurm'",
        "cfg.executor != 'local'",
        "executor in ('ray', 'slurm')",
    ]
    asked = {
        str(path.relative_to(ROOT)): found
        for package in ("porting", "data_prep", "converters", "models")
        for path in sorted((ROOT / package).rglob("*.py"))
        if (found := _name_comparisons(path.read_text()))
    }
    assert asked == {}


def test_an_executor_added_to_the_table_runs_an_import(cli, tiny_llama, tmp_path, monkeypatch):
    """A fourth executor is one class and one line in the table: ``import --executor`` offers it,
    checks its launch, hands it the staging directory and takes rank 0's report from it."""
    from porting.convert import executors, ranks

    seen = {}

    class Planted(executors.ConversionExecutor):
        name = "planted"
        help = "ranks somewhere else"
        starts_ranks = True

        def launch(self, command, argv, stage_dir, args):
            seen.update(command=command, argv=argv)
            (stage_dir / "weights").mkdir()
            where = stage_dir / ranks.RANKS_DIR
            where.mkdir(exist_ok=True)
            (where / "report.out").write_text("the planted ranks' report\n")
            (where / "verdict").write_text("passed\n")
            return None

    monkeypatch.setitem(executors.EXECUTORS.by_name, "planted", Planted())
    out = tmp_path / "ckpt"
    done = cli(["import", str(tiny_llama), "--out", str(out), "--executor", "planted",
                "--nproc-per-node", "1", "--no-verify"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert seen == {
        "command": "import",
        "argv": [str(tiny_llama), "--out", str(out), "--no-verify"],
    }
    assert done.stdout == f"the planted ranks' report\nwrote {out} (1 rank)\n"
    assert sorted(p.name for p in out.iterdir()) == ["weights"]


def test_a_failing_added_executor_leaves_no_output(cli, tiny_llama, tmp_path, monkeypatch):
    from porting.convert import executors
    from porting.errors import PortingError

    class Failing(executors.ConversionExecutor):
        name = "failing"
        help = "ranks that fail"
        starts_ranks = True

        def launch(self, command, argv, stage_dir, args):
            (stage_dir / "half-written").write_text(json.dumps({"rank": 1}))
            raise PortingError("rank 1 failed: planted")

    monkeypatch.setitem(executors.EXECUTORS.by_name, "failing", Failing())
    out = tmp_path / "ckpt"
    done = cli(["import", str(tiny_llama), "--out", str(out), "--executor", "failing",
                "--nproc-per-node", "1", "--no-verify"])  # fmt: skip
    assert done.returncode == 2
    assert "rank 1 failed: planted" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
