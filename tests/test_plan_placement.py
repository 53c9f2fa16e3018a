"""Rank placement checked with Megatron-Core's own RankGenerator (not a re-implementation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from porting.planner import load_cluster, plan
from porting.planner.model import PRESETS
from porting.planner.placement import ORDER_DEFAULT, ORDER_TP_PP_DP, Topology, rank_groups

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"


@pytest.fixture(scope="module")
def megatron_rank_generator():
    from megatron.core.parallel_state import RankGenerator

    return RankGenerator


@pytest.mark.parametrize("order", [ORDER_TP_PP_DP, ORDER_DEFAULT])
@pytest.mark.parametrize("tp, cp, pp, dp", [(2, 1, 2, 2), (4, 2, 2, 3), (1, 4, 3, 2), (8, 1, 4, 4)])
@pytest.mark.parametrize("token", ["tp", "cp", "pp", "dp", "dp-cp"])
def test_rank_groups_equal_megatrons(megatron_rank_generator, order, tp, cp, pp, dp, token):
    gen = megatron_rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    world = tp * cp * pp * dp
    sizes = {"tp": tp, "cp": cp, "ep": 1, "pp": pp, "dp": dp}
    assert rank_groups(world, sizes, order, token) == gen.get_ranks(token)


@pytest.mark.parametrize("order", [ORDER_TP_PP_DP, ORDER_DEFAULT])
@pytest.mark.parametrize(
    "etp, ep, edp, pp", [(1, 8, 2, 2), (2, 4, 2, 3), (4, 2, 1, 2), (1, 16, 1, 1)]
)
@pytest.mark.parametrize("token", ["tp", "ep", "dp"])
def test_expert_groups_equal_megatrons(megatron_rank_generator, order, etp, ep, edp, pp, token):
    # Megatron's expert rank generator: ETP x EP x EDP x PP in the same order string, CP 1
    gen = megatron_rank_generator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    sizes = {"tp": etp, "cp": 1, "ep": ep, "pp": pp, "dp": edp}
    assert rank_groups(etp * ep * edp * pp, sizes, order, token) == gen.get_ranks(token)


@pytest.mark.parametrize(
    "model, cluster, batch",
    [
        ("deepseek-v3", "h800-2048.yaml", 15360),
        ("qwen3-235b-a22b", "dgx-h100-one-site.yaml", 1024),
        ("mixtral-8x22b", "two-sites.yaml", 1024),
        ("llama3.1-405b", "racks-zones.yaml", 3072),
        ("llama-70b", "three-sites.yaml", 1024),
    ],
)
def test_planned_layouts_pass_megatrons_own_rank_checks(
    megatron_rank_generator, model, cluster, batch
):
    """What initialize_model_parallel asserts before it builds a group: under tp-cp-ep-pp-dp with
    PP > 1 the expert grid's data-parallel size is the attention's, both grids have the same
    pipeline groups, and the distributed-optimizer instances divide the expert data-parallel
    size. Checked with Megatron's RankGenerator on the plan's top layouts."""
    m = PRESETS[model]
    result = plan(m, load_cluster(EXAMPLES / cluster), 4096, batch)
    for p in result.ranked[:25]:
        lay = p.layout
        etp = lay.etp if m.moe else lay.tp
        edp = lay.tp * lay.cp * lay.dp // (lay.ep * etp)
        gen = megatron_rank_generator(
            tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order=p.order
        )
        experts = megatron_rank_generator(tp=etp, ep=lay.ep, dp=edp, pp=lay.pp, cp=1, order=p.order)
        assert p.order.endswith("pp") or lay.pp == 1 or edp == lay.dp, lay.label()
        assert gen.get_ranks("pp") == experts.get_ranks("pp"), lay.label()
        if m.moe:
            assert edp % lay.instances == 0, lay.label()


@pytest.fixture(scope="module")
def three_site_plan():
    cluster = load_cluster(EXAMPLES / "three-sites.yaml")
    return plan(PRESETS["llama-70b"], cluster, 4096, 1024)


def _check_groups(gen_cls, cluster, p):
    """Megatron's own groups for a prediction's layout and placement: TP inside a node, each
    distributed-optimizer instance inside a site, and (with the tp-cp-ep-pp-dp order) each
    pipeline inside a site. Returns (pipelines, pipelines that cross sites)."""
    lay = p.layout
    topo = Topology(cluster.reordered(lay.sites))
    gen = gen_cls(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order=lay.order)
    for g in gen.get_ranks("tp"):
        assert len({topo.node_of[r] for r in g}) == 1, (lay.label(), g)
    # Megatron cuts each dp-cp group into equal contiguous instances
    # (parallel_state.initialize_model_parallel); each must stay inside one site.
    for g in gen.get_ranks("dp-cp"):
        size = len(g) // lay.instances
        for i in range(lay.instances):
            chunk = g[i * size : (i + 1) * size]
            assert len({topo.site_of[r] for r in chunk}) == 1, (lay.label(), chunk)
    pipes = gen.get_ranks("pp")
    crossing = [g for g in pipes if len({topo.site_of[r] for r in g}) > 1]
    if lay.order == ORDER_TP_PP_DP:
        assert not crossing, lay.label()
    return pipes, crossing


def test_emitted_layouts_keep_tp_in_nodes_and_instances_in_sites(
    megatron_rank_generator, three_site_plan
):
    cluster = three_site_plan.cluster
    orders = set()
    for p in three_site_plan.ranked[:40] + three_site_plan.placements:
        assert p.order == p.layout.order
        _check_groups(megatron_rank_generator, cluster, p)
        orders.add(p.order)
    assert orders == {ORDER_TP_PP_DP, ORDER_DEFAULT}


def test_the_chosen_pipeline_crosses_the_sites_over_the_fast_links(
    megatron_rank_generator, three_site_plan
):
    """three-sites: a-b 2 x 400 Gb/s RDMA, b-c 2 x 200 Gb/s RDMA, c-a 4 x 100 Gb/s TCP. The
    chosen placement runs the pipeline a > b > c, so no stage boundary is on the TCP link; with
    its layout, Megatron's groups show pipelines that do cross sites."""
    best = three_site_plan.best
    assert best.order == ORDER_DEFAULT and best.layout.sites == ("a", "b", "c")
    _, crossing = _check_groups(megatron_rank_generator, three_site_plan.cluster, best)
    assert crossing
    topo = Topology(three_site_plan.cluster.reordered(best.layout.sites))
    names = [s.name for s in three_site_plan.cluster.reordered(best.layout.sites).sites]
    hops = set()
    for g in crossing:
        for a, b in zip(g, g[1:], strict=False):
            sa, sb = names[topo.site_of[a]], names[topo.site_of[b]]
            if sa != sb:
                hops.add(frozenset((sa, sb)))
    assert hops and frozenset(("a", "c")) not in hops
    labels = [p.layout.placement_label() for p in three_site_plan.placements]
    assert "data-parallel across sites" in labels and len(labels) == len(set(labels)) == 4
    assert any("placement:" in n for n in three_site_plan.notes)


def test_instances_follow_the_sites():
    cluster = load_cluster(EXAMPLES / "three-sites.yaml")
    # sites of 128, 128 and 256 GPUs: with replicas inside the sites, instances of 128 GPUs'
    # worth of replicas, two in site c; with stages across sites, as few as keep each inside one
    result = plan(PRESETS["llama-70b"], cluster, 4096, 1024)
    replicas = [p for p in result.ranked if p.order == ORDER_TP_PP_DP][:10]
    assert replicas and all(p.layout.instances == 4 for p in replicas)
    one = load_cluster(EXAMPLES / "dgx-h100-one-site.yaml")
    for p in plan(PRESETS["llama-70b"], one, 4096, 512).ranked[:10]:
        assert p.layout.instances == 1
