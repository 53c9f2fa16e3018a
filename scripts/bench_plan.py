"""Benchmark `porting plan`'s search: a 70B model on the three-site, 512-GPU example cluster.

Prints the wall time of each repeat (model and cluster loading included, output excluded) and
the number of layouts considered. Target: under 2 s.

    .venv/bin/python scripts/bench_plan.py [--repeats 5] [--model llama-70b]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from porting.planner import load_cluster, load_model, plan

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-70b")
    parser.add_argument("--cluster", type=Path, default=ROOT / "examples/clusters/three-sites.yaml")
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
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
