"""Plain-text table and JSON for a plan (pure functions: the CLI prints what they return)."""

from __future__ import annotations

from dataclasses import asdict

from porting.planner.cluster import GIB
from porting.planner.perf import Prediction
from porting.planner.search import Plan


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _levels(d: dict[str, float]) -> str:
    return "/".join(f"{d[k]:.2f}" for k in ("node", "site", "wan"))


def header(plan: Plan) -> str:
    """What was planned, and how much of the space was looked at."""
    c = plan.cluster
    gpu = c.slowest_gpu()
    sites = ", ".join(f"{s.name}: {s.nodes}x{s.gpus_per_node}" for s in c.sites)
    return (
        f"model {plan.model.name} ({plan.model.total_params() / 1e9:.1f}B parameters) on "
        f"{c.name}: {c.world} x {gpu.name} in {len(c.sites)} site(s) ({sites})\n"
        f"global batch {plan.global_batch} x {plan.seq_length} tokens; considered "
        f"{plan.considered} layouts in {plan.seconds:.2f} s: {len(plan.ranked)} feasible, "
        f"{len(plan.rejected)} rejected"
    )


def _rows(rows: list[Prediction], multi: bool, first: str = "#") -> list[str]:
    cols = (
        f"{first:>3}  {'layout':<34} {'step s':>8} {'tokens/s':>10} {'MFU':>6}  "
        f"{'mem GiB w/g/o/act/other = total':<34} {'exposed s node/site/wan':<24} "
        f"{'hidden s node/site/wan':<24} {'vs 1 site':>9}"
    )
    lines = [cols + ("  placement" if multi else "")]
    for i, p in enumerate(rows, 1):
        mem = p.memory
        parts = "/".join(_gib(x) for x in (mem.weights, mem.grads, mem.optimizer))
        parts += f"/{_gib(mem.activations)}/{_gib(mem.other)} = {_gib(mem.total)}"
        slow = f"{p.slowdown:.2f}x" if p.slowdown is not None else "-"
        lines.append(
            f"{i:>3}  {p.layout.label():<34} {p.step:>8.2f} {p.tokens_per_s:>10,.0f} "
            f"{p.mfu * 100:>5.1f}%  {parts:<34} {_levels(p.exposed):<24} "
            f"{_levels(p.hidden):<24} {slow:>9}"
            + (f"  {p.layout.placement_label()}" if multi else "")
        )
    return lines


def table(plan: Plan, top: int = 10) -> str:
    """The ranked layouts: step time, throughput, MFU, memory by part, communication by level,
    and (across sites) the placement: which parallel dimension crosses the links."""
    return "\n".join(_rows(plan.ranked[:top], len(plan.cluster.sites) > 1))


def placements(plan: Plan) -> str:
    """The fastest layout of each placement side by side (empty for one site)."""
    if len(plan.cluster.sites) < 2 or not plan.placements:
        return ""
    head = "the best layout of each placement (rank order, and the order the sites take ranks):"
    return "\n".join([head, *_rows(plan.placements, True)])


def breakdown(p: Prediction) -> str:
    """Where the chosen layout's step time goes."""
    total = p.step
    items = ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in p.parts.items() if v > 0)
    return f"step {total:.2f} s = {items}"


def rejected(plan: Plan, limit: int | None = None) -> str:
    """Rejected layouts with their reasons."""
    rows = plan.rejected if limit is None else plan.rejected[:limit]
    return "\n".join(f"  {r.label}: {r.reason}" for r in rows)


def prediction_dict(p: Prediction) -> dict:
    """A prediction as JSON-ready data."""
    mem = p.memory
    return {
        "layout": asdict(p.layout),
        "label": p.layout.label(),
        "rank_order": p.order,
        "placement": p.layout.placement_label(),
        "site_order": list(p.layout.sites),
        "step_s": p.step,
        "tokens_per_s": p.tokens_per_s,
        "mfu": p.mfu,
        "num_microbatches": p.num_microbatches,
        "memory_gib": {
            "weights": mem.weights / GIB,
            "grads": mem.grads / GIB,
            "optimizer": mem.optimizer / GIB,
            "activations": mem.activations / GIB,
            "other": mem.other / GIB,
            "total": mem.total / GIB,
            "stage": mem.stage,
        },
        "parts_s": p.parts,
        "exposed_comm_s": p.exposed,
        "hidden_comm_s": p.hidden,
        "slowdown_vs_one_site": p.slowdown,
    }


def plan_dict(plan: Plan, top: int = 10, with_rejected: bool = False) -> dict:
    """The whole plan as JSON-ready data (the chosen layout first in ``layouts``)."""
    c = plan.cluster
    out = {
        "model": asdict(plan.model),
        "cluster": {
            "name": c.name,
            "gpus": c.world,
            "sites": [
                {"name": s.name, "nodes": s.nodes, "gpus_per_node": s.gpus_per_node}
                for s in c.sites
            ],
        },
        "global_batch": plan.global_batch,
        "seq_length": plan.seq_length,
        "settings": asdict(plan.settings),
        "efficiency": asdict(plan.eff),
        "considered": plan.considered,
        "feasible": len(plan.ranked),
        "seconds": plan.seconds,
        "layouts": [prediction_dict(p) for p in plan.ranked[:top]],
        "placements": [prediction_dict(p) for p in plan.placements],
        "notes": plan.notes,
    }
    if with_rejected:
        out["rejected"] = [{"layout": r.label, "reason": r.reason} for r in plan.rejected]
    return out


def groups(ev, p: Prediction) -> str:
    """Where each parallel group of ``p`` sits: node, the sites' racks and zones, sites."""
    lay = p.layout
    place = ev.topology_for(lay.sites).placement(
        lay.tp, lay.cp, lay.pp, lay.dp, lay.instances, p.order, lay.ep, lay.etp
    )
    net = ev.net
    parts = []
    if lay.tp > 1:
        parts.append(f"TP{lay.tp} {net.where(place.tp.level, place.tp.tier)}")
    if lay.cp > 1:
        parts.append(f"CP{lay.cp} {net.where(place.cp.level, place.cp.tier)}")
    if lay.ep > 1:
        parts.append(f"EP{lay.ep} {net.where(place.ep.level, place.ep.tier)}")
    if lay.pp > 1:
        level = max(lv for lv, _ in place.pp_boundaries)
        tier = max(place.pp_tiers[:-1])
        parts.append(f"PP{lay.pp} {net.where(level, tier)}")
    if lay.dp > 1:
        parts.append(f"DP{lay.dp} {net.where(place.dp.level, place.dp.tier)}")
    return "; ".join(parts) or "one GPU holds the model"
