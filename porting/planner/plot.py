"""A PNG of the plan: step-time parts of the top layouts, and the chosen layout's slowdown
against the same GPUs in one site as inter-site bandwidth and distance vary."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from porting.planner.cluster import link_rtt
from porting.planner.perf import Evaluator, Infeasible, Prediction
from porting.planner.search import Plan

BANDWIDTH_SCALES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
DISTANCES_KM = (0.0, 10.0, 25.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


@dataclass(frozen=True)
class Sweep:
    """Slowdown of one layout (step / step on one site) over link bandwidth and distance."""

    label: str
    bandwidth_scale: tuple[float, ...]
    by_bandwidth: tuple[float, ...]
    distance_km: tuple[float, ...]
    by_distance: tuple[float, ...]


def sweep(plan: Plan, ev: Evaluator, p: Prediction | None = None) -> Sweep:
    """Predict ``p`` (default: the best layout) with every link scaled or moved."""
    p = p or plan.best
    cluster = plan.cluster
    base = ev.with_cluster(cluster.one_site()).predict(p.layout).step

    def slowdown(c) -> float:
        """Step on cluster ``c`` over the one-site step (NaN where the layout cannot run)."""
        try:
            return ev.with_cluster(c).predict(p.layout, order=p.order).step / base
        except Infeasible:
            return float("nan")

    by_bw = []
    for f in BANDWIDTH_SCALES:
        links = tuple(replace(ln, bandwidth=ln.bandwidth * f) for ln in cluster.links)
        by_bw.append(slowdown(replace(cluster, links=links)))
    edge = max(s.net.latency for s in cluster.sites)
    by_km = [slowdown(cluster.with_links(rtt=link_rtt(km, edge))) for km in DISTANCES_KM]
    return Sweep(p.layout.label(), BANDWIDTH_SCALES, tuple(by_bw), DISTANCES_KM, tuple(by_km))


def write_plot(path: str | os.PathLike, plan: Plan, ev: Evaluator, top: int = 8) -> Path:
    """Draw the plan into a PNG at ``path`` (written to a temporary name, then renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    preds = plan.ranked[:top]
    multi = len(plan.cluster.sites) > 1 and plan.cluster.links
    fig, axes = plt.subplots(1, 3 if multi else 1, figsize=(17 if multi else 8, 5.5), squeeze=False)
    ax = axes[0][0]
    names = list(preds[0].parts)
    bottom = [0.0] * len(preds)
    for name in names:
        vals = [p.parts[name] for p in preds]
        ax.bar(range(len(preds)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(preds)))
    ax.set_xticklabels([p.layout.label() for p in preds], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"{plan.model.name} on {plan.cluster.name}: top layouts")
    ax.legend(fontsize=7)
    if multi:
        sw = sweep(plan, ev)
        ax = axes[0][1]
        ax.plot(sw.bandwidth_scale, sw.by_bandwidth, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("inter-site bandwidth (x the cluster file's)")
        ax.set_ylabel("slowdown vs one site")
        ax.set_title(sw.label)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax = axes[0][2]
        ax.plot(sw.distance_km, sw.by_distance, marker="o")
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlabel("inter-site distance (km, every link)")
        ax.set_ylabel("slowdown vs one site")
        ax.set_title(sw.label)
        ax.axhline(1.0, color="grey", lw=0.5)
    fig.tight_layout()
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out
