"""Benchmark `porting plan`'s search: a 70B model on the three-site, 512-GPU example cluster, and
with ``--worst`` the worst clusters the planner accepts (docs/planner.md "Limits").

Default: the wall time of each repeat (model and cluster loading included, output excluded) and
the number of layouts considered. Target: under 2 s.

``--worst``: each case in a fresh process (so that its peak RSS is its own), from writing the
cluster file to the ranked plan: wall and CPU time, peak RSS, and what bounds the work (orders of
the sites tried, layouts considered, placements worked out).

    .venv/bin/python scripts/bench_plan.py [--repeats 5] [--model llama-70b]
    .venv/bin/python scripts/bench_plan.py --worst
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from porting.errors import PortingError
from porting.planner import load_cluster, load_model, plan
from porting.planner.limits import MAX_GPUS, MAX_SITES
from porting.planner.perf import Settings

ROOT = Path(__file__).resolve().parents[1]
H100 = {"name": "H100", "peak_bf16_tflops": 989, "memory_gib": 80, "hbm_tbytes_s": 3.35}


def _cluster(n: int, nodes: int, gpus_per_node: int = 8, *, ring: bool) -> dict:
    """``n`` sites of ``nodes`` nodes, in a ring or every pair linked (links of varied speed)."""
    names = [f"s{i}" for i in range(n)]
    if ring:
        pairs = [(names[i], names[(i + 1) % n]) for i in range(n if n > 2 else 1)]
    else:
        pairs = list(itertools.combinations(names, 2))
    return {
        "name": f"{n}-sites-{'ring' if ring else 'mesh'}",
        "gpu": H100,
        "node": {"bandwidth_gbytes_s": 450, "latency_us": 3},
        "site": {"bandwidth_gbit_s": 400, "latency_us": 5},
        "sites": [{"name": x, "nodes": nodes, "gpus_per_node": gpus_per_node} for x in names],
        "links": [
            {"sites": [a, b], "bandwidth_gbit_s": 100 + (37 * i) % 300, "distance_km": 10 + i % 90}
            for i, (a, b) in enumerate(pairs)
        ],
    }


PER_SITE = MAX_GPUS // MAX_SITES // 8  # nodes of 8 GPUs in each of the most sites
# name: (cluster, model, global batch, micro-batch sizes)
WORST = {
    "three sites, 512 GPUs (the example)": (None, "llama-70b", 1024, None),
    f"{MAX_SITES} sites fully linked, {MAX_GPUS:,} GPUs": (
        _cluster(MAX_SITES, PER_SITE, ring=False),
        "llama-70b",
        1 << 20,
        None,
    ),
    f"{MAX_SITES} sites in a ring, {MAX_GPUS:,} GPUs": (
        _cluster(MAX_SITES, PER_SITE, ring=True),
        "llama-70b",
        1 << 20,
        None,
    ),
    f"{MAX_SITES} sites fully linked, 245,760 GPUs (2^14 x 15)": (
        _cluster(MAX_SITES, 480, ring=False),
        "llama-70b",
        15 << 20,
        None,
    ),
    f"2 sites of {MAX_GPUS // 2:,} one-GPU nodes": (
        _cluster(2, MAX_GPUS // 2, gpus_per_node=1, ring=True),
        "llama-7b",
        1 << 20,
        None,
    ),
    "4 sites fully linked, 16 micro-batch sizes (orders cut)": (
        _cluster(4, 15, ring=False),
        "llama-7b",
        2**11 * 105,
        tuple(range(1, 17)),
    ),
    f"{MAX_SITES} sites fully linked, {MAX_GPUS:,} GPUs, deepseek-v3 (MoE: EP x ETP searched)": (
        _cluster(MAX_SITES, PER_SITE, ring=False),
        "deepseek-v3",
        1 << 20,
        None,
    ),
    "one site, 2,048 H800s, deepseek-v3 (the report's cluster)": (
        "examples/clusters/h800-2048.yaml",
        "deepseek-v3",
        15360,
        None,
    ),
    "a 512 KiB cluster file of 100k+ values (refused)": ("hostile", "llama-7b", 64, None),
}


def run_case(name: str) -> dict:
    """One case, measured from writing its cluster file to the ranked plan."""
    data, model, global_batch, micro = WORST[name]
    settings = Settings(micro_batches=micro) if micro else None
    t0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        path = ROOT / "examples/clusters/three-sites.yaml" if data is None else Path(tmp) / "c.yaml"
        if isinstance(data, str) and data.startswith("examples/"):
            path = ROOT / data
        elif data == "hostile":
            path.write_text(("sites: [" + "{a: 1}, " * 70_000)[: 512 << 10])
        elif data is not None:
            path.write_text(yaml.safe_dump(data))
        out: dict = {}
        try:
            result = plan(load_model(model), load_cluster(path), 4096, global_batch, settings)
        except PortingError as err:
            out["refused"] = str(err)[:60]
        else:
            out.update(
                gpus=result.cluster.world,
                sites=len(result.cluster.sites),
                orders=len(result.site_orders),
                considered=result.considered,
                feasible=len(result.ranked),
                placements=result.placements_computed,
                best=result.best.layout.label(),
            )
    out["wall_s"] = time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - c0
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def worst() -> None:
    """Every case of WORST in its own process, as a table."""
    print(
        "| case | GPUs | site orders tried | layouts considered | placements | wall s | CPU s "
        "| peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name in WORST:
        child = subprocess.run(
            [sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True
        )
        r = json.loads(child.stdout)
        cost = f"{r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['peak_rss_mib']:.0f}"
        if "refused" in r:
            print(f"| {name} | refused: {r['refused']}... | | | | {cost} |")
            continue
        print(
            f"| {name} | {r['gpus']:,} | {r['orders']} | {r['considered']:,} | {r['placements']:,} "
            f"| {cost} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-70b")
    parser.add_argument("--cluster", type=Path, default=ROOT / "examples/clusters/three-sites.yaml")
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worst", action="store_true", help="the worst accepted clusters")
    parser.add_argument("--case", choices=list(WORST), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    if args.worst:
        worst()
        return
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        result = plan(
            load_model(args.model), load_cluster(args.cluster), args.seq_length, args.global_batch
        )
        times.append(time.perf_counter() - t0)
    c = result.cluster
    print(
        f"{args.model} on {c.name} ({c.world} GPUs, {len(c.sites)} sites), global batch "
        f"{args.global_batch} x {args.seq_length}"
    )
    print(
        f"layouts considered: {result.considered} ({len(result.ranked)} feasible, "
        f"{len(result.rejected)} rejected); best {result.best.layout.label()} "
        f"{result.best.step:.2f} s/step"
    )
    print(
        f"plan time over {args.repeats} runs: min {min(times):.3f} s, median "
        f"{statistics.median(times):.3f} s, max {max(times):.3f} s (target < 2 s)"
    )


if __name__ == "__main__":
    main()
