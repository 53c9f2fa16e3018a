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


@pytest.fixture(scope="module")
def three_site_plan():
    cluster = load_cluster(EXAMPLES / "three-sites.yaml")
    return plan(PRESETS["llama-70b"], cluster, 4096, 1024)


def test_emitted_layouts_keep_tp_in_nodes_and_pp_in_sites(megatron_rank_generator, three_site_plan):
    cluster = three_site_plan.cluster
    topo = Topology(cluster)
    checked_tp = checked_pp = 0
    for p in three_site_plan.ranked[:40]:
        lay = p.layout
        assert p.order == ORDER_TP_PP_DP
        gen = megatron_rank_generator(
            tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order=ORDER_TP_PP_DP
        )
        for g in gen.get_ranks("tp"):
            assert len({topo.node_of[r] for r in g}) == 1, (lay.label(), g)
            checked_tp += lay.tp > 1
        for g in gen.get_ranks("pp"):
            assert len({topo.site_of[r] for r in g}) == 1, (lay.label(), g)
            checked_pp += lay.pp > 1
        # Megatron cuts each dp-cp group into equal contiguous instances
        # (parallel_state.initialize_model_parallel); each must stay inside one site.
        for g in gen.get_ranks("dp-cp"):
            size = len(g) // lay.instances
            for i in range(lay.instances):
                chunk = g[i * size : (i + 1) * size]
                assert len({topo.site_of[r] for r in chunk}) == 1, (lay.label(), chunk)
    assert checked_tp and checked_pp


def test_default_order_would_split_pipelines_across_sites(megatron_rank_generator, three_site_plan):
    best = three_site_plan.best.layout
    assert best.pp > 1
    topo = Topology(three_site_plan.cluster)
    gen = megatron_rank_generator(
        tp=best.tp, ep=1, dp=best.dp, pp=best.pp, cp=best.cp, order=ORDER_DEFAULT
    )
    assert any(len({topo.site_of[r] for r in g}) > 1 for g in gen.get_ranks("pp"))
    assert any("default rank order" in n for n in three_site_plan.notes)


def test_instances_follow_the_sites():
    cluster = load_cluster(EXAMPLES / "three-sites.yaml")
    # sites of 128, 128 and 256 GPUs: instances of 128 GPUs' worth of replicas, two in site c
    for p in plan(PRESETS["llama-70b"], cluster, 4096, 1024).ranked[:10]:
        assert p.layout.instances == 4
    one = load_cluster(EXAMPLES / "dgx-h100-one-site.yaml")
    for p in plan(PRESETS["llama-70b"], one, 4096, 512).ranked[:10]:
        assert p.layout.instances == 1
