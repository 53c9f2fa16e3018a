"""The layout search: every TP/CP/PP/VP/DP/micro-batch/recomputation that divides the model and
the cluster, ranked by predicted step time, with the reason for each rejection kept."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from porting.errors import PortingError
from porting.planner.cluster import GIB, Cluster
from porting.planner.comm import Efficiency
from porting.planner.limits import GLOBAL_BATCH, MAX_LAYOUTS, MAX_SITE_ORDERS, SEQ_LENGTH
from porting.planner.model import ModelShape, divisors
from porting.planner.perf import (
    Evaluator,
    Infeasible,
    Layout,
    Prediction,
    Settings,
)
from porting.planner.placement import ORDER_DEFAULT, ORDER_TP_PP_DP, WAN

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
    # the orders of the sites a pipeline across them was tried in
    site_orders: list[tuple[str, ...]] = field(default_factory=list)
    placements_computed: int = 0  # rank placements worked out (the search's other work)
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
    for pp in divisors(world // model_parallel):
        if pp > m.layers:
            break
        if m.layers % pp == 0:
            yield pp, None
        elif s.uneven_pipeline:
            split = uneven_split(m.layers, pp)
            if split is not None:
                yield pp, split


def _placements(
    ev: Evaluator, tp: int, cp: int, pp: int, site_orders: list[tuple[str, ...]]
) -> Iterator[tuple[str, tuple, str | None]]:
    """(rank order, site order, reason it cannot be used or None) for a TP x CP x PP layout.

    With PP = 1 both orders give the same groups. The tp-cp-ep-pp-dp order keeps each model
    replica in a block of consecutive ranks, which must not straddle two sites. Under the default
    order pipeline stages take consecutive blocks of ranks, so the order in which the sites take
    ranks decides which links the pipeline crosses: each order the links allow is tried. Inside
    one site without racks or zones only the first of the orders searched is used (both see the
    same levels); a site with them tries both.
    """
    cluster, s = ev.cluster, ev.settings
    mp = tp * cp * pp
    multi = len(cluster.sites) > 1
    if pp == 1:
        yield ORDER_TP_PP_DP, (), None
        return
    if not multi:
        if cluster.sites[0].domains:
            for order in s.orders:
                yield order, (), None
        else:
            # both orders see the same levels: one of them, not every layout twice
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
            for sites in site_orders:
                yield order, sites, None


def _model_splits(ev: Evaluator) -> Iterator[Rejected | tuple[int, int, int, tuple | None]]:
    """Every TP x CP x PP split of the model over the cluster (with its uneven split of the
    layers, or None), or a Rejected with the rule it breaks; nothing placed yet."""
    m, cluster, s = ev.model, ev.cluster, ev.settings
    world = cluster.world
    for tp, why in _tp_candidates(m, cluster):
        if why:
            yield Rejected(f"TP{tp}", why)
            continue
        for cp in s.context_parallel:
            if cp > 1 and ev.seq % (2 * cp):
                yield Rejected(
                    f"TP{tp} CP{cp}",
                    f"sequence length {ev.seq} is not divisible by 2 x CP = {2 * cp}",
                )
                continue
            if world % (tp * cp):
                yield Rejected(
                    f"TP{tp} CP{cp}", f"TP x CP = {tp * cp} does not divide {world} GPUs"
                )
                continue
            for pp, split in _pipeline_sizes(m, tp * cp, world, s):
                yield tp, cp, pp, split


def _vps(ev: Evaluator, pp: int, split: tuple | None) -> list[int]:
    """Interleaving degrees to try: divisors of the layers per stage up to ``max_vp``."""
    if pp == 1 or split is not None:
        return [1]
    return [1] + [v for v in divisors(ev.model.layers // pp) if 1 < v <= ev.settings.max_vp]


def _batch_rule(ev: Evaluator, dp: int, pp: int, vp: int, b: int) -> str | None:
    """Why micro-batch ``b`` cannot run with this DP, PP and VP, or None."""
    gb = ev.global_batch
    if gb % (b * dp):
        return f"global batch {gb} is not divisible by micro-batch {b} x DP {dp}"
    nmb = gb // (b * dp)
    if vp > 1 and nmb % pp:
        return f"interleaved schedule needs the {nmb} microbatches to be a multiple of PP {pp}"
    return None


def expert_options(
    ev: Evaluator, tp: int, cp: int, pp: int
) -> Iterator[tuple[int, int, str | None]]:
    """(EP, ETP, reason it cannot be used or None) for the MoE layers of a TP x CP x PP split.

    MoE Parallel Folding (Liu et al. 2025, arXiv 2504.14960; Megatron-Core's expert rank
    generator): the MoE layers regroup the TP x CP x DP ranks of each pipeline stage into
    ETP x EP x EDP, sharing only PP with attention. ETP is tried at 1 (experts whole, the paper's
    best configurations) and at TP (Megatron's default); EP at every divisor of the experts that
    tiles the stage (or those ``--ep`` names). A dense model has one option, (1, 1).
    """
    m, s = ev.model, ev.settings
    if not m.moe:
        yield 1, 1, None
        return
    stage = ev.cluster.world // pp
    wanted = s.expert_parallel or tuple(divisors(m.experts))
    for etp in sorted({1, tp}):
        for ep in wanted:
            if m.experts % ep:
                yield ep, etp, f"EP {ep} does not divide the {m.experts} experts"
            elif stage % (ep * etp):
                yield (
                    ep,
                    etp,
                    f"EP {ep} x ETP {etp} does not divide the {stage} GPUs of a pipeline stage "
                    f"(TP {tp} x CP {cp} x DP {stage // (tp * cp)})",
                )
            else:
                yield ep, etp, None


def megatron_order_rule(
    order: str, tp: int, cp: int, pp: int, ep: int, etp: int, moe: bool
) -> str | None:
    """Why Megatron-Core refuses this rank order for the split, or None.

    With the tp-cp-ep-pp-dp order and PP > 1, ``initialize_model_parallel`` (and NeMo's
    ``megatron_init``) asserts that the MoE layers' data-parallel size equals the attention's
    and that both grids have the same pipeline groups: EP x ETP = TP x CP. Its expert grid
    exists for a dense model too (EP 1, ETP = TP), so there it means CP 1.
    """
    if order != ORDER_TP_PP_DP or pp == 1:
        return None
    etp = etp if moe else tp
    if ep * etp == tp * cp:
        return None
    if not moe:
        return (
            f"CP {cp} with PP {pp} under the tp-cp-ep-pp-dp order: Megatron requires its expert "
            f"data-parallel size (CP x DP) to equal DP there"
        )
    return (
        f"EP {ep} x ETP {etp} = {ep * etp} is not TP x CP = {tp * cp}: with the tp-cp-ep-pp-dp "
        "order and PP > 1 Megatron requires the MoE and attention layers' data-parallel sizes "
        "(and pipeline groups) to be the same"
    )


def _expand(
    ev: Evaluator,
    tp: int,
    cp: int,
    pp: int,
    split: tuple | None,
    order: str,
    sites: tuple[str, ...],
    instances: int,
) -> Iterator[Layout | Rejected]:
    """Every expert split, interleaving, micro-batch and recomputation of one placed split."""
    for ep, etp, here, why in _expert_choices(ev, tp, cp, pp, order, instances):
        if why:
            yield Rejected(f"TP{tp} PP{pp} CP{cp} EP{ep} ETP{etp}", why)
            continue
        yield from _expand_batches(ev, tp, cp, pp, split, here, sites, instances, ep, etp)


def _expert_choices(
    ev: Evaluator, tp: int, cp: int, pp: int, order: str, instances: int | None
) -> Iterator[tuple[int, int, str, str | None]]:
    """(EP, ETP, the rank order it runs with, reason it cannot run or None) for a placed split;
    ``instances`` None: not known yet (the rule on them is left out)."""
    m, s = ev.model, ev.settings
    one_level = len(ev.cluster.sites) == 1 and not ev.cluster.sites[0].domains
    dp = ev.cluster.world // (tp * cp * pp)
    for ep, etp, why in expert_options(ev, tp, cp, pp):
        here = order
        if not why:
            why = megatron_order_rule(here, tp, cp, pp, ep, etp, m.moe)
            if why and one_level and ORDER_DEFAULT in s.orders:
                # inside one plain site the default order sees the same levels, without the rule
                here, why = ORDER_DEFAULT, None
        if not why and m.moe and s.distributed_optimizer and instances:
            edp = tp * cp * dp // (ep * etp)
            if edp % instances:
                why = (
                    f"{instances} distributed-optimizer instances do not divide the expert "
                    f"data-parallel size {edp}"
                )
        yield ep, etp, here, why


def _expand_batches(
    ev: Evaluator,
    tp: int,
    cp: int,
    pp: int,
    split: tuple | None,
    order: str,
    sites: tuple[str, ...],
    instances: int,
    ep: int,
    etp: int,
) -> Iterator[Layout | Rejected]:
    s = ev.settings
    dp = ev.cluster.world // (tp * cp * pp)
    first, middle, last = split or (0, 0, 0)
    for vp in _vps(ev, pp, split):
        for b in s.micro_batches:
            why = _batch_rule(ev, dp, pp, vp, b)
            if why:
                lab = f"TP{tp} PP{pp}" + (f" VP{vp}" if vp > 1 else "") + f" CP{cp} DP{dp} mb{b}"
                yield Rejected(lab, why)
                continue
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
                    ep=ep,
                    etp=etp,
                )


def _instances_rule(dp: int, cp: int, instances: int) -> str | None:
    if (dp * cp) % instances:
        return f"{instances} distributed-optimizer instances do not divide DP x CP = {dp * cp}"
    return None


def enumerate_layouts(
    ev: Evaluator, site_orders: list[tuple[str, ...]] | None = None
) -> Iterator[Layout | Rejected]:
    """Every candidate layout and placement, or a Rejected with the rule it breaks; pipelines
    across sites take the sites in each of ``site_orders`` (default: the cluster's)."""
    if site_orders is None:
        site_orders = ev.cluster.site_orders()
    for item in _model_splits(ev):
        if isinstance(item, Rejected):
            yield item
            continue
        tp, cp, pp, split = item
        dp = ev.cluster.world // (tp * cp * pp)
        for order, sites, why in _placements(ev, tp, cp, pp, site_orders):
            instances = 1 if why else ev.instances_for(tp, cp, pp, order, sites)
            why = why or _instances_rule(dp, cp, instances)
            if why:
                yield Rejected(f"TP{tp} PP{pp} CP{cp}", why)
                continue
            yield from _expand(ev, tp, cp, pp, split, order, sites, instances)


def search_size(ev: Evaluator) -> tuple[int, int]:
    """(candidates :func:`enumerate_layouts` yields whatever the orders of the sites, the
    candidates it adds for each order of the sites), counted without placing anything.

    Stops counting past ``MAX_LAYOUTS``: the caller refuses such a search anyway.
    """
    s = ev.settings
    multi = len(ev.cluster.sites) > 1
    fixed = per_order = 0
    for item in _model_splits(ev):
        if fixed + per_order > MAX_LAYOUTS:
            break
        if isinstance(item, Rejected):
            fixed += 1
            continue
        tp, cp, pp, split = item
        dp = ev.cluster.world // (tp * cp * pp)
        batches = sum(
            1 if _batch_rule(ev, dp, pp, vp, b) else len(s.recompute)
            for vp in _vps(ev, pp, split)
            for b in s.micro_batches
        )
        for order, _sites, why in _placements(ev, tp, cp, pp, [()]):
            each_order = multi and pp > 1 and order != ORDER_TP_PP_DP
            if why:
                n = 1
            else:
                instances = None  # the fewest that keep sites apart divide DP x CP
                if not (each_order and s.distributed_optimizer and s.instances is None):
                    instances = ev.instances_for(tp, cp, pp, order)
                if instances is not None and _instances_rule(dp, cp, instances):
                    n = 1
                else:
                    choices = _expert_choices(ev, tp, cp, pp, order, instances)
                    n = sum(1 if w else batches for *_, w in choices)
            if each_order:
                per_order += n
            else:
                fixed += n
    return fixed, per_order


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

    At most ``MAX_LAYOUTS`` candidates: where every order of the sites would take more, the
    pipeline across sites is tried in as many of them as fit (the file order, then the best by
    their links), and a search that one order already takes past it is refused with what to
    narrow. Raises PortingError naming the constraint when no layout is feasible (the most
    common rejection reasons are in the message).
    """
    SEQ_LENGTH.check(seq_length, "--seq-length")
    GLOBAL_BATCH.check(global_batch, "--global-batch")
    t0 = time.perf_counter()
    ev = Evaluator(model, cluster, seq_length, global_batch, settings, eff)
    orders, notes = _site_orders_within_budget(ev)
    ranked, rejected, considered = _ranked(ev, orders)
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
        notes=notes,
        site_orders=orders,
    )
    if not ranked:
        raise PortingError(no_fit_message(result))
    one = ev.with_cluster(cluster.one_site()) if len(cluster.sites) > 1 else None
    if one is not None:
        for p in ranked[:slowdown_top]:
            _set_slowdown(p, one)
    best = ranked[0]
    seen: dict[str, Prediction] = {}
    for p in ranked:
        seen.setdefault(p.layout.placement_label(), p)
    result.placements = list(seen.values())
    if one is not None:
        _placement_notes(result, best, one)
    if model.moe:
        result.notes.extend(expert_notes(ev, ranked))
        if ev.settings.dispatcher == "flex":
            result.notes.append(
                "dispatcher: predicted for DeepEP (Megatron's flex dispatcher, strategy.py); "
                "porting train runs Megatron's alltoall dispatcher"
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
    result.placements_computed = ev.placements_computed()
    result.seconds = time.perf_counter() - t0
    log.debug("planned %d layouts in %.3f s", considered, result.seconds)
    return result


def _ranked(ev: Evaluator, orders) -> tuple[list[Prediction], list[Rejected], int]:
    """Every candidate layout predicted (or rejected, with why), the feasible ones by step time
    then memory; and how many were considered."""
    ranked: list[Prediction] = []
    rejected: list[Rejected] = []
    considered = 0
    for item in enumerate_layouts(ev, orders):
        considered += 1
        if isinstance(item, Rejected):
            rejected.append(item)
            continue
        try:
            ranked.append(ev.predict(item))
        except Infeasible as err:
            rejected.append(Rejected(item.label(), str(err)))
    ranked.sort(key=lambda p: (p.step, p.memory.total))
    return ranked, rejected, considered


def _set_slowdown(p: Prediction, one: Evaluator) -> None:
    """``p``'s step time against the same GPUs in one site (None where one site cannot hold it)."""
    try:
        p.slowdown = p.step / one.predict(p.layout).step
    except Infeasible:
        p.slowdown = None


def _placement_notes(result: Plan, best: Prediction, one: Evaluator) -> None:
    """Each placement's slowdown against one site, and what the best placement beats."""
    for p in result.placements:
        if p.slowdown is None:
            _set_slowdown(p, one)
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


def expert_notes(ev: Evaluator, ranked: list[Prediction]) -> list[str]:
    """Where the best layout's EP group sits and what the fastest layout with EP at each other
    level (and without EP) costs: EP inside the fastest domain unless a wider group is predicted
    faster, and then both are shown."""
    best_at: dict[tuple[int, int], Prediction] = {}
    for p in ranked:
        lay = p.layout
        key = (-1, 0)  # no expert parallelism
        if lay.ep > 1:
            place = ev.topology_for(lay.sites).placement(
                lay.tp, lay.cp, lay.pp, lay.dp, lay.instances, p.order, lay.ep, lay.etp
            )
            key = (place.ep.level, place.ep.tier)
        best_at.setdefault(key, p)

    def where(key: tuple[int, int]) -> str:
        return "without EP" if key[0] < 0 else f"with EP {ev.net.where(*key)}"

    best = ranked[0]
    mine = next(k for k, p in best_at.items() if p is best)
    if mine[0] < 0:
        head = (
            "expert parallelism: none (each GPU holds every expert of its stage's layers): "
            + _experts_said(ev, best)
        )
    else:
        head = (
            f"expert parallelism: EP{best.layout.ep} ETP{best.layout.etp} "
            f"{ev.net.where(*mine)}: {_experts_said(ev, best)}"
        )
        if mine > (0, 0):
            head += (
                " (a wider EP group is predicted faster than any inside a node)"
                if (0, 0) in best_at
                else " (no layout with EP inside a node fits)"
            )
    others = [
        f"{where(k)}: {p.layout.label()} ({p.step:.2f} s, {p.step / best.step:.2f}x: "
        f"{_experts_said(ev, p)})"
        for k, p in sorted(best_at.items())
        if p is not best
    ]
    return [head + ("; the best " + "; ".join(others) if others else "")]


def _experts_said(ev: Evaluator, p: Prediction) -> str:
    """What EP buys and costs in ``p``: the rows each expert's GEMM gets, the rate those GEMMs
    reach, the all-to-all, and the memory a GPU needs."""
    ex = ev.experts(p.layout)
    m = ev.model
    # the routed experts' FLOPs of a micro-batch's MoE layer on one GPU: forward and backward
    flops = 6 * ex.tokens_per_expert * ex.local_experts * m.expert_params() / p.layout.etp
    rate = flops / (ex.forward + ex.backward) / ev.gpu.peak_flops
    return (
        f"{ex.tokens_per_expert:,.0f} tokens per expert ({ex.local_experts} local), expert "
        f"GEMMs {p.parts.get('expert GEMMs', 0.0):.2f} s at {rate:.0%} of peak, all-to-all "
        f"{p.parts.get('ep comm', 0.0):.2f} s of the {p.step:.2f} s step, "
        f"{p.memory.total / GIB:.1f} GiB a GPU"
    )


def _site_orders_within_budget(ev: Evaluator) -> tuple[list[tuple[str, ...]], list[str]]:
    """The orders of the sites to try pipelines in, keeping the search within ``MAX_LAYOUTS``,
    and a note where some were left out."""
    cluster = ev.cluster
    orders = cluster.site_orders()
    fixed, per_order = search_size(ev)
    if fixed + per_order > MAX_LAYOUTS:
        raise PortingError(
            f"planning {ev.model.name} on {cluster.name} ({cluster.world} GPUs) at global batch "
            f"{ev.global_batch} would consider more than the planner's limit of {MAX_LAYOUTS} "
            "layouts; narrow the search (--micro-batches, --order, --no-uneven-pipeline"
            + (", --ep" if ev.model.moe else "")
            + ")"
        )
    notes = []
    fit = len(orders) if not per_order else (MAX_LAYOUTS - fixed) // per_order
    if fit < len(orders):
        best = sorted(orders[1:], key=cluster.order_key)[: fit - 1]
        orders = [orders[0], *best]
        notes.append(
            f"pipelines across the sites tried in {fit} of their orders (the file's and the "
            f"best by their links) to keep the search within {MAX_LAYOUTS} layouts"
        )
    elif not cluster.every_site_order:
        notes.append(
            f"pipelines across the sites tried in {len(orders)} of their orders (the file's and "
            f"the best by their links): the links allow more than {MAX_SITE_ORDERS}"
        )
    return orders, notes


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
