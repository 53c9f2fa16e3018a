"""scripts/bench_suite.py: the per-file table of a suite run, and the interpreters each file
started, counted from what scripts/suite_children/sitecustomize.py records."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_suite", REPO / "scripts/bench_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_interpreter_is_counted_for_the_file_whose_case_started_it(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PORTING_PROC_LOG": str(log), "PYTHONPATH": str(REPO / "scripts" / "suite_children")}
    for case in ("tests/test_a.py::test_one (call)", "tests/test_a.py::test_two (setup)", ""):
        done = subprocess.run(
            [sys.executable, "-c", "print('ok')"],
            env=env | {"PYTEST_CURRENT_TEST": case},
            capture_output=True,
            text=True,
            check=True,
        )
        assert (done.stdout, done.stderr) == ("ok\n", "")  # the child prints nothing of ours
    # a grandchild inherits the case it was started for
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
    env |= {"PYTEST_CURRENT_TEST": "tests/test_b.py::test_x (call)"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    (log / "torn.json").write_text("{")  # a record cut short is left out, not fatal
    assert _bench().children_per_file(log) == {"tests/test_a.py": 2, "tests/test_b.py": 2}
    records = [json.loads(p.read_text()) for p in log.glob("*-*.json")]
    assert len(records) == 5 and all(r["argv"][0] == sys.executable for r in records)


def test_without_the_log_directory_nothing_is_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PORTING_PROC_LOG")}
    env["PYTHONPATH"] = str(REPO / "scripts" / "suite_children")
    subprocess.run([sys.executable, "-c", "pass"], env=env, cwd=tmp_path, check=True)
    assert list(tmp_path.iterdir()) == []


def test_the_table_gains_a_column_of_interpreters(tmp_path, capsys):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_one" time="2.5">'
        '<properties><property name="cpu_s" value="1.0"/>'
        '<property name="children_cpu_s" value="3.0"/></properties></testcase>'
        '<testcase classname="tests.test_b" name="test_x" time="1.0"/></testsuite></testsuites>'
    )
    log = tmp_path / "log"
    log.mkdir()
    (log / "1-1.json").write_text(json.dumps({"argv": ["python"], "test": "tests/test_a.py::t"}))
    assert _bench().main([str(report), "--children", str(log)]) == 0
    table = capsys.readouterr().out
    assert "| tests/test_a.py | 1 | 2 | 71.4% | 1 + 3 | 1 | test_one (2) |" in table, table
    assert "| tests/test_b.py | 1 | 1 | 28.6% | 0 + 0 | 0 | test_x (1) |" in table, table
    assert "1 interpreters started by the cases in all." in table


def test_each_kind_of_interpreter_is_summed_apart_for_those_that_loaded_nemo(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PORTING_PROC_LOG": str(log), "PYTHONPATH": str(REPO / "scripts" / "suite_children")}
    # one ends normally, one through os._exit (as our commands do), one loads a "nemo" module
    nemo = tmp_path / "fake" / "nemo"
    nemo.mkdir(parents=True)
    (nemo / "__init__.py").write_text("")
    for code, extra in (
        ("pass", {}),
        ("import os; os._exit(0)", {}),
        ("import nemo", {"PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(nemo.parent)}),
    ):
        subprocess.run([sys.executable, "-c", code], env=env | extra, check=True)
    kinds = _bench().children_by_command(log)
    assert sorted((k, len(v)) for k, v in kinds.items()) == [
        (("python -c", False), 2),
        (("python -c", True), 1),
    ]
    assert all(t >= 0 for v in kinds.values() for t in v)
    assert _bench()._command([sys.executable, "-m", "porting.cli", "import", "x"]) == (
        "porting import"
    )


def test_each_worker_shows_its_cases_busy_seconds_and_when_it_ended(tmp_path, capsys):
    def case(name, worker, started, ended):
        return (
            f'<testcase classname="tests.test_a" name="{name}" time="{ended - started}">'
            f'<properties><property name="worker" value="{worker}"/>'
            f'<property name="started" value="{started}"/>'
            f'<property name="ended" value="{ended}"/></properties></testcase>'
        )

    report = tmp_path / "junit.xml"
    report.write_text(
        "<testsuites><testsuite>"
        + case("test_1", "gw0", 1000.0, 1010.0)
        + case("test_2", "gw0", 1012.0, 1100.0)
        + case("test_3", "gw1", 1001.0, 1031.0)
        + "</testsuite></testsuites>"
    )
    assert _bench().per_worker(report) == {
        "gw0": {"cases": 2, "busy_s": 98.0, "first_s": 0.0, "last_s": 100.0},
        "gw1": {"cases": 1, "busy_s": 30.0, "first_s": 1.0, "last_s": 31.0},
    }
    assert _bench().main([str(report)]) == 0
    assert "| gw1 | 1 | 30 | 1 | 31 |" in capsys.readouterr().out
