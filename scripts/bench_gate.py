"""Benchmark: the parity gate against its floor, this code against an earlier checkout.

Writes the gate's benchmark stack (``bench_scale.py``'s ``7b-8``: a Llama-layout bf16 checkpoint
4096 wide, 8 layers, FFN 11008, MHA, vocab 32000; random weights) unless it is there, imports it
once without the gate, then runs ``porting verify --json --device cpu`` on it in a fresh process
per run, alternating the code trees round by round so that load from other processes hits both
alike. For each run: the command's wall time (start-up and NeMo's import included), the gate's
own (its report's ``wall_s``), the layers that left the tolerance on their own input (each of
them runs again on HF's input), and the floor and rate each report gave.

The ratios are taken against one floor: both sides' matmul work, the same for both trees (the
same prompts and shapes), at the best fp32 rate this benchmark measured (``porting.parity.floor``'s
shape, once before each run: on shared cores the load of other jobs comes and goes, and a floor is
what the machine can do). Each report's own floor is shown beside it: this tree's comes from the
rate cached once per machine, an earlier tree's from a rate it measured in each run at the
layers' shape, which moved with the load of that moment. CPU seconds (the command's user + sys)
are shown too: less sensitive than wall time to other jobs on the same cores.

    python scripts/bench_gate.py --before /tmp/head [--rounds 2] [--workdir /tmp/bench-gate]

``--before``: a checkout of the earlier code (``git archive HEAD | tar -x -C /tmp/head``); its
``porting`` package is imported from there (``python -m`` puts the working directory first).
Without it only this tree runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_verify(tree: Path, hf: Path, ckpt: Path, log: Path) -> dict:
    """``porting verify --json --device cpu`` from ``tree``: its wall and the report's figures."""
    cmd = [sys.executable, "-m", "porting.cli", "verify", str(hf), str(ckpt), "--json"]
    cmd += ["--device", "cpu"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"verify from {tree} exited {proc.returncode}; see {log}")
    report = json.loads(proc.stdout)
    layers = report["layers"]
    # the layers the Megatron side ran again on HF's input (an earlier tree's report has no
    # own_on_hf_input: it ran every layer again but the first, whose inputs are equal)
    rerun = sum(d.get("own_on_hf_input", True) for d in layers[1:])
    return {
        "all_in_s": wall,
        "cpu_s": cpu,
        "gate_s": report["wall_s"],
        "own_floor_s": report["floor_s"],
        "own_gflops": report["matmul_gflops"],
        "tflop": report["matmul_tflop"],
        "rerun": rerun,
        "layers": len(layers),
        "passed": report["passed"],
    }


def _cell(rows: list[dict], key: str) -> str:
    """``median (min)`` of one column."""
    values = [x[key] for x in rows]
    return f"{statistics.median(values):.1f} ({min(values):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--before", type=Path, help="a checkout of the earlier code")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-gate"))
    args = p.parse_args()

    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO))  # this tree's porting, wherever it is installed from
    import torch
    from bench_scale import SIZES, write_checkpoint

    from porting.parity.floor import RATE_SHAPE, measure_gflops

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    hf, ckpt = work / "hf-7b-8", work / "nemo-7b-8"
    if not (hf / "config.json").exists():
        write_checkpoint(hf, **SIZES["7b-8"])
    if not ckpt.exists():
        cmd = [sys.executable, "-m", "porting.cli", "import", str(hf), "--out", str(ckpt)]
        subprocess.run([*cmd, "--no-verify"], cwd=REPO, check=True)
    trees = {"after": REPO} | ({"before": args.before.resolve()} if args.before else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    rates = []
    for r in range(args.rounds):
        names = list(trees)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rates.append(measure_gflops(torch.device("cpu"), *RATE_SHAPE))
            row = run_verify(trees[name], hf, ckpt, work / f"verify-{name}-{r}.log")
            runs[name].append(row)
            print(f"round {r} {name}: {json.dumps(row)}", file=sys.stderr, flush=True)

    rate = max(rates)
    tflop = runs["after"][0]["tflop"]
    floor_s = tflop * 1e12 / (rate * 1e9)
    print(
        f"7B-shaped stack, 8 layers, bf16 ({hf}); cpu, torch threads {torch.get_num_threads()}; "
        f"floor {floor_s:.1f} s = {tflop:.2f} TFLOP of matmul (both sides) at {rate:.0f} GFLOP/s "
        f"(best of {len(rates)} measurements, from {min(rates):.0f}); median (min) of "
        f"{args.rounds} runs"
    )
    print(
        f"{'code':<8}{'all-in s':>15}{'CPU s':>15}{'gate s':>15}{'all-in/floor':>14}"
        f"{'gate/floor':>12}{'re-run':>8}{'its floor s':>13}{'its GFLOP/s':>13}"
    )
    for name, rows in runs.items():
        med_all = statistics.median(x["all_in_s"] for x in rows)
        med_gate = statistics.median(x["gate_s"] for x in rows)
        rerun = f"{rows[0]['rerun']}/{rows[0]['layers']}"
        print(
            f"{name:<8}{_cell(rows, 'all_in_s'):>15}{_cell(rows, 'cpu_s'):>15}"
            f"{_cell(rows, 'gate_s'):>15}"
            f"{med_all / floor_s:>13.2f}x{med_gate / floor_s:>11.2f}x{rerun:>8}"
            f"{statistics.median(x['own_floor_s'] for x in rows):>13.1f}"
            f"{statistics.median(x['own_gflops'] for x in rows):>13.0f}"
        )
    if not all(x["passed"] for rows in runs.values() for x in rows):
        raise SystemExit("a gate failed on the clean stack")


if __name__ == "__main__":
    main()
