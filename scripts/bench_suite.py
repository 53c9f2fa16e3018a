"""Where the test suite's time goes: one row per test file from a pytest JUnit XML report.

    scripts/env.sh test --junitxml=/tmp/junit.xml      # the whole suite, as CI runs it
    .venv/bin/python scripts/bench_suite.py /tmp/junit.xml [--top 30]

    # and the interpreters each file starts, and each kind's CPU seconds
    # (scripts/suite_children/sitecustomize.py):
    mkdir /tmp/pl && PORTING_PROC_LOG=/tmp/pl PYTHONPATH=$PWD/scripts/suite_children \
        scripts/env.sh test --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/bench_suite.py /tmp/junit.xml --children /tmp/pl

Prints a Markdown table (docs/testing.md keeps the latest): each file's cases, the seconds its
cases took (setup, call and teardown, as pytest's report counts them; a session fixture's cost
lands on the first case that asks for it), its share of the whole, the CPU seconds of the test
process and of the children it waited for (tests/conftest.py records both per case; what Slurm's
daemons start is in neither), and its slowest case. With two workers the seconds add up to about
twice the wall time. With ``--children``, a column of the interpreters each file started and a
second table: the CPU seconds of each kind of interpreter (a ``porting`` subcommand, a script, a
module), apart for those that loaded NeMo, Slurm's jobs included. Where the report has the
per-case times tests/conftest.py records, a table per xdist worker: its cases, the seconds they
took, and when its first started and its last ended (a worker that ends early left a core idle).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def per_file(report: Path) -> tuple[dict[str, dict], float, int]:
    """``{file: {cases, seconds, cpu_s, children_cpu_s, slowest, slowest_s}}``, the suite's
    seconds and its cases."""
    root = ET.parse(report).getroot()
    files: dict[str, dict] = defaultdict(
        lambda: {
            "cases": 0,
            "seconds": 0.0,
            "cpu_s": 0.0,
            "children_cpu_s": 0.0,
            "slowest": "",
            "slowest_s": 0.0,
        }  # fmt: skip
    )
    total, cases = 0.0, 0
    for case in root.iter("testcase"):
        seconds = float(case.get("time", 0) or 0)
        where = case.get("classname", "?").split(".")
        name = "/".join(where[:-1] if where[-1][:1].isupper() else where) + ".py"
        row = files[name]
        row["cases"] += 1
        row["seconds"] += seconds
        for prop in case.iter("property"):
            if prop.get("name") in ("cpu_s", "children_cpu_s"):
                row[prop.get("name")] += float(prop.get("value", 0))
        if seconds > row["slowest_s"]:
            row["slowest"], row["slowest_s"] = case.get("name", "?"), seconds
        total += seconds
        cases += 1
    return dict(files), total, cases


def per_worker(report: Path) -> dict[str, dict]:
    """``{worker: {cases, busy_s, first_s, last_s}}``: the seconds its cases took, and when its
    first case started and its last ended, counted from the run's first case (the properties
    tests/conftest.py records; empty for a report without them)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for case in ET.parse(report).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "started" in props and "ended" in props:
            spans[props.get("worker", "?")].append((float(props["started"]), float(props["ended"])))
    if not spans:
        return {}
    zero = min(a for runs in spans.values() for a, _ in runs)
    return {
        worker: {
            "cases": len(runs),
            "busy_s": sum(b - a for a, b in runs),
            "first_s": min(a for a, _ in runs) - zero,
            "last_s": max(b for _, b in runs) - zero,
        }
        for worker, runs in sorted(spans.items())
    }


def children_per_file(directory: Path) -> dict[str, int]:
    """``{file: interpreters started for its cases}`` from the records
    scripts/suite_children/sitecustomize.py leaves in ``directory``."""
    import json

    counts: dict[str, int] = defaultdict(int)
    for record in directory.glob("*.json"):
        try:
            test = json.loads(record.read_text())["test"]
        except (OSError, ValueError, KeyError):
            continue
        if test:  # the workers themselves, and what starts between cases, belong to no file
            counts[test.split("::", 1)[0]] += 1
    return dict(counts)


def children_by_command(directory: Path) -> dict[tuple[str, bool], list[float]]:
    """``{(command, loaded NeMo): [CPU seconds of each interpreter]}`` from the exit records
    scripts/suite_children/sitecustomize.py leaves in ``directory`` (an interpreter killed by a
    signal leaves none). The command is ``porting <subcommand>`` for our CLI, else the script or
    module an interpreter ran."""
    import json

    out: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for record in directory.glob("*.json"):
        try:
            argv = json.loads(record.read_text())["argv"]
            ended = json.loads(record.with_suffix(".exit").read_text())
        except (OSError, ValueError, KeyError):
            continue
        out[(_command(argv), "nemo" in ended["loaded"])].append(float(ended["cpu_s"]))
    return dict(out)


def _command(argv: list[str]) -> str:
    for i, arg in enumerate(argv[:-1]):
        if arg == "porting.cli" or arg.endswith("/porting"):
            return f"porting {argv[i + 1]}"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    if "-c" in argv:
        return "python -c"
    scripts = [a for a in argv[1:] if a.endswith(".py")]
    return Path(scripts[0]).name if scripts else Path(argv[0]).name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="pytest's --junitxml file")
    p.add_argument("--top", type=int, default=30, help="rows to print (default 30)")
    p.add_argument(
        "--children",
        type=Path,
        help="the PORTING_PROC_LOG directory of the same run: adds the interpreters each file "
        "started",
    )
    args = p.parse_args(argv)
    files, total, cases = per_file(args.report)
    started = children_per_file(args.children) if args.children else None
    cpu = sum(r["cpu_s"] + r["children_cpu_s"] for r in files.values())
    print(f"{cases} cases, {total / 60:.1f} min of test time, {cpu / 60:.1f} CPU-min counted\n")
    more = " interpreters started |" if started is not None else ""
    print(f"| file | cases | seconds | share | CPU s (own + children) |{more} slowest case (s) |")
    print("|---|---:|---:|---:|---:|" + ("---:|" if started is not None else "") + "---|")
    ranked = sorted(files.items(), key=lambda kv: -kv[1]["seconds"])
    for name, row in ranked[: args.top]:
        count = f" {started.get(name, 0)} |" if started is not None else ""
        print(
            f"| {name} | {row['cases']} | {row['seconds']:.0f} | "
            f"{100 * row['seconds'] / total:.1f}% | "
            f"{row['cpu_s']:.0f} + {row['children_cpu_s']:.0f} |{count} "
            f"{row['slowest']} ({row['slowest_s']:.0f}) |"
        )
    rest = ranked[args.top :]
    if rest:
        seconds = sum(r["seconds"] for _, r in rest)
        own = sum(r["cpu_s"] for _, r in rest)
        children = sum(r["children_cpu_s"] for _, r in rest)
        count = f" {sum(started.get(n, 0) for n, _ in rest)} |" if started is not None else ""
        print(
            f"| {len(rest)} other files | {sum(r['cases'] for _, r in rest)} | {seconds:.0f} | "
            f"{100 * seconds / total:.1f}% | {own:.0f} + {children:.0f} |{count} |"
        )
    workers = per_worker(args.report)
    if workers:
        print("\n| worker | cases | busy s | first case starts (s) | last case ends (s) |")
        print("|---|---:|---:|---:|---:|")
        for worker, row in workers.items():
            print(
                f"| {worker} | {row['cases']} | {row['busy_s']:.0f} | {row['first_s']:.0f} | "
                f"{row['last_s']:.0f} |"
            )
    if started is not None:
        print(f"\n{sum(started.values())} interpreters started by the cases in all.\n")
        print("| interpreter | NeMo loaded | count | CPU s | CPU s each |")
        print("|---|---|---:|---:|---:|")
        commands = children_by_command(args.children)
        for (command, nemo), cpu_s in sorted(commands.items(), key=lambda kv: -sum(kv[1])):
            if sum(cpu_s) >= 10:
                print(
                    f"| {command} | {'yes' if nemo else 'no'} | {len(cpu_s)} | "
                    f"{sum(cpu_s):.0f} | {sum(cpu_s) / len(cpu_s):.1f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
