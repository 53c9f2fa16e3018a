"""The layout search: every TP/CP/PP/VP/DP/micro-batch/recomputation that divides the model and
the cluster, ranked by predicted step time, with the reason for each rejection kept."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from porting.errors import PortingError
from porting.planner.cluster import Cluster
from porting.planner.comm import Efficiency
from porting.planner.model import ModelShape, divisors
from porting.planner.perf import (
    Evaluator,
    Infeasible,
    Layout,
    Prediction,
    Settings,
)
from porting.planner.placement import ORDER_TP_PP_DP, WAN

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rejected:
    """A layout that was considered and why it cannot run."""

    label: str
    reason: str


@dataclass
class Plan:
    """The outcome of a search: feasible layouts fastest first, and the rejected ones."""

    model: ModelShape
    cluster: Cluster
    seq_length: int
    global_batch: int
    settings: Settings
    eff: Efficiency
    ranked: list[Prediction]
    rejected: list[Rejected]
    considered: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    # the fastest layout of each placement (which dimension crosses the sites), fastest first
    placements: list[Prediction] = field(default_factory=list)

    @property
    def best(self) -> Prediction:
        """The fastest feasible layout."""
        return self.ranked[0]


def _tp_candidates(m: ModelShape, cluster: Cluster) -> Iterator[tuple[int, str | None]]:
    top = max(s.gpus_per_node for s in cluster.sites)
    seen = sorted({d for d in divisors(m.heads) if d <= top} | {1 << i for i in range(8)})
    for tp in seen:
        if tp > top:
            continue
        if m.heads % tp or m.kv_heads % tp:
            yield tp, f"TP {tp} does not divide {m.heads} attention heads and {m.kv_heads} KV heads"
            continue
        bad = [s for s in cluster.sites if s.gpus_per_node % tp]
        if bad:
            yield (
                tp,
                (
                    f"TP {tp} does not divide site {bad[0].name}'s {bad[0].gpus_per_node} GPUs per "
                    "node (TP stays inside a node)"
                ),
            )
            continue
        yield tp, None


def uneven_split(layers: int, pp: int) -> tuple[int, int, int] | None:
    """Megatron's first / middle / last stage layers for a PP size that does not divide them.

    Middle stages take ``ceil(layers / pp)``; the first and the last share the rest, the last
    (which also computes the logits) taking the smaller half. ``None`` where no split gives every
    stage at least one layer.
    """
    if pp < 2 or layers % pp == 0 or layers < pp:
        return None
    if pp == 2:
        return (layers - layers // 2, 0, layers // 2)
    mid = -(-layers // pp)
    rest = layers - mid * (pp - 2)
    if rest < 2:
        return None
    return (rest - rest // 2, mid, rest // 2)


def _pipeline_sizes(m: ModelShape, model_parallel: int, world: int, s: Settings):
    """PP sizes to try, each with its uneven split (``None``: the layers divide evenly)."""
    for pp in range(1, m.layers + 1):
        if world % (model_parallel * pp):
            continue
        if m.layers % pp == 0:
            yield pp, None
        elif s.uneven_pipeline:
            split = uneven_split(m.layers, pp)
            if split is not None:
                yield pp, split


def _placements(
    ev: Evaluator, tp: int, cp: int, pp: int
) -> Iterator[tuple[str, tuple, str | None]]:
    """(rank order, site order, reason it cannot be used or None) for a TP x CP x PP layout.

    With PP = 1 both orders give the same groups. The tp-cp-ep-pp-dp order keeps each model
    replica in a block of consecutive ranks, which must not straddle two sites. Under the default
    order pipeline stages take consecutive blocks of ranks, so the order in which the sites take
    ranks decides which links the pipeline crosses: each order the links allow is tried. Inside
    one site only the first of the orders searched is used.
    """
    cluster, s = ev.cluster, ev.settings
    mp = tp * cp * pp
    multi = len(cluster.sites) > 1
    if pp == 1:
        yield ORDER_TP_PP_DP, (), None
        return
    if not multi:
        # inside one site both orders see the same levels: one of them, not every layout twice
        yield s.orders[0], (), None
        return
    for order in s.orders:
        if order == ORDER_TP_PP_DP:
            bad = [site for site in cluster.sites if site.gpus % mp]
            why = None
            if bad:
                why = (
                    f"TP x CP x PP = {mp} does not divide site {bad[0].name}'s {bad[0].gpus} GPUs "
                    "(with the tp-cp-ep-pp-dp order a model replica would straddle two sites)"
                )
            yield order, (), why
        else:
            for sites in cluster.site_orders():
                yield order, sites, None


def enumerate_layouts(
    ev: Evaluator,
) -> Iterator[Layout | Rejected]:
    """Every candidate layout and placement, or a Rejected with the rule it breaks."""
    m, cluster, s = ev.model, ev.cluster, ev.settings
    seq, gb = ev.seq, ev.global_batch
    world = cluster.world
    for tp, why in _tp_candidates(m, cluster):
        if why:
            yield Rejected(f"TP{tp}", why)
            continue
        for cp in s.context_parallel:
            if cp > 1 and seq % (2 * cp):
                yield Rejected(
                    f"TP{tp} CP{cp}",
                    f"sequence length {seq} is not divisible by 2 x CP = {2 * cp}",
                )
                continue
            if world % (tp * cp):
                yield Rejected(
                    f"TP{tp} CP{cp}", f"TP x CP = {tp * cp} does not divide {world} GPUs"
                )
                continue
            for pp, split in _pipeline_sizes(m, tp * cp, world, s):
                dp = world // (tp * cp * pp)
                label = f"TP{tp} PP{pp} CP{cp}"
                for order, sites, why in _placements(ev, tp, cp, pp):
                    if why:
                        yield Rejected(label, why)
                        continue
                    instances = ev.instances_for(tp, cp, pp, order, sites)
                    if (dp * cp) % instances:
                        yield Rejected(
                            label,
                            f"{instances} distributed-optimizer instances do not divide DP x CP = "
                            f"{dp * cp}",
                        )
                        continue
                    vps = [1]
                    if pp > 1 and split is None:
                        vps += [v for v in divisors(m.layers // pp) if 1 < v <= s.max_vp]
                    for vp in vps:
                        for b in s.micro_batches:
                            lab = f"TP{tp} PP{pp}" + (f" VP{vp}" if vp > 1 else "")
                            lab += f" CP{cp} DP{dp} mb{b}"
                            if gb % (b * dp):
                                yield Rejected(
                                    lab,
                                    f"global batch {gb} is not divisible by micro-batch {b} x "
                                    f"DP {dp}",
                                )
                                continue
                            nmb = gb // (b * dp)
                            if vp > 1 and nmb % pp:
                                yield Rejected(
                                    lab,
                                    f"interleaved schedule needs the {nmb} microbatches to be a "
                                    f"multiple of PP {pp}",
                                )
                                continue
                            first, middle, last = split or (0, 0, 0)
                            for rc in s.recompute:
                                yield Layout(
                                    tp=tp,
                                    cp=cp,
                                    pp=pp,
                                    vp=vp,
                                    dp=dp,
                                    micro_batch=b,
                                    recompute=rc,
                                    instances=instances,
                                    sequence_parallel=s.sequence_parallel and tp > 1,
                                    order=order,
                                    sites=sites,
                                    first_layers=first,
                                    middle_layers=middle,
                                    last_layers=last,
                                )


def plan(
    model: ModelShape,
    cluster: Cluster,
    seq_length: int,
    global_batch: int,
    settings: Settings | None = None,
    eff: Efficiency | None = None,
    *,
    slowdown_top: int = 10,
) -> Plan:
    """Search every layout, rank the feasible ones by predicted step time.

    Raises PortingError naming the constraint when no layout is feasible (the most common
    rejection reasons are in the message).
    """
    if seq_length <= 0:
        raise PortingError(f"--seq-length must be positive, got {seq_length}")
    if global_batch <= 0:
        raise PortingError(f"--global-batch must be positive, got {global_batch}")
    t0 = time.perf_counter()
    ev = Evaluator(model, cluster, seq_length, global_batch, settings, eff)
    ranked: list[Prediction] = []
    rejected: list[Rejected] = []
    considered = 0
    for item in enumerate_layouts(ev):
        considered += 1
        if isinstance(item, Rejected):
            rejected.append(item)
            continue
        try:
            ranked.append(ev.predict(item))
        except Infeasible as err:
            rejected.append(Rejected(item.label(), str(err)))
    ranked.sort(key=lambda p: (p.step, p.memory.total))
    result = Plan(
        model=model,
        cluster=cluster,
        seq_length=seq_length,
        global_batch=global_batch,
        settings=ev.settings,
        eff=ev.eff,
        ranked=ranked,
        rejected=rejected,
        considered=considered,
        seconds=0.0,
    )
    if not ranked:
        raise PortingError(no_fit_message(result))
    if len(cluster.sites) > 1:
        one = ev.with_cluster(cluster.one_site())
        for p in ranked[:slowdown_top]:
            try:
                p.slowdown = p.step / one.predict(p.layout).step
            except Infeasible:
                p.slowdown = None
    best = ranked[0]
    seen: dict[str, Prediction] = {}
    for p in ranked:
        seen.setdefault(p.layout.placement_label(), p)
    result.placements = list(seen.values())
    if len(cluster.sites) > 1:
        for p in result.placements:
            if p.slowdown is None:
                try:
                    p.slowdown = p.step / one.predict(p.layout).step
                except Infeasible:
                    p.slowdown = None
        others = [p for p in result.placements if p is not best]
        if others:
            beaten = ", ".join(
                f"{p.layout.placement_label()} ({p.step:.2f} s, {p.step / best.step:.2f}x)"
                for p in others
            )
            result.notes.append(
                f"placement: {best.layout.placement_label()} ({best.step:.2f} s per step) beats "
                f"the best with {beaten}"
            )
    lay = best.layout
    place = ev.topology_for(lay.sites).placement(
        lay.tp, lay.cp, lay.pp, lay.dp, lay.instances, best.order
    )
    if lay.instances > 1 and place.instance.level < WAN:
        result.notes.append(
            f"{best.layout.instances} distributed-optimizer instances: gradients are "
            "reduce-scattered inside each instance (never across sites) and only the shards "
            "are all-reduced across instances."
        )
    result.seconds = time.perf_counter() - t0
    log.debug("planned %d layouts in %.3f s", considered, result.seconds)
    return result


def no_fit_message(result: Plan) -> str:
    """Why nothing fits, naming the constraint that rejected the most layouts."""
    counts: dict[str, int] = {}
    for r in result.rejected:
        key = r.reason.split(" (")[0] if "GiB" not in r.reason else "memory"
        counts[key] = counts.get(key, 0) + 1
    mem = [r for r in result.rejected if "GiB" in r.reason]
    gpu = result.cluster.slowest_gpu()
    parts = [
        f"model {result.model.name} fits nowhere on cluster {result.cluster.name} "
        f"({result.cluster.world} GPUs, {gpu.memory_bytes / 2**30:.0f} GiB each) at global "
        f"batch {result.global_batch} and sequence length {result.seq_length}"
    ]
    if mem:
        least = min(mem, key=lambda r: float(r.reason.split()[1]))
        parts.append(f"smallest memory need: {least.label}: {least.reason}")
    others = sorted(((n, k) for k, n in counts.items() if k != "memory"), reverse=True)[:3]
    for n, k in others:
        parts.append(f"{n} layouts: {k}")
    return "; ".join(parts)
