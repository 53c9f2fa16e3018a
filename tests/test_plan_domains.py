"""Levels inside a site: racks, zones and buildings in a cluster file, where each parallel group
sits among them, what crossing them costs, and the refusals (docs/planner.md "Racks and zones")."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from porting.errors import PortingError
from porting.planner.cluster import cluster_from_dict, load_cluster
from porting.planner.model import PRESETS
from porting.planner.perf import Evaluator, Layout, Settings
from porting.planner.placement import NODE, ORDER_DEFAULT, ORDER_TP_PP_DP, SITE, Topology
from porting.planner.search import plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"

BASE = {
    "name": "zoned",
    "gpu": {"name": "H100", "peak_bf16_tflops": 989, "memory_gib": 80, "hbm_tbytes_s": 3.35},
    "node": {"bandwidth_gbytes_s": 450, "latency_us": 3},
    "site": {
        "bandwidth_gbit_s": 400,
        "latency_us": 5,
        "domains": [
            {"name": "rack", "nodes": 2, "latency_us": 7},
            {"name": "zone", "nodes": 8, "oversubscription": 4, "latency_us": 12},
        ],
    },
    "sites": [{"name": "dc", "nodes": 32, "gpus_per_node": 8}],
}


def _cluster(**site):
    data = copy.deepcopy(BASE)
    data["site"].update(site)
    return cluster_from_dict(data, "zoned.yaml")


def test_each_group_is_told_the_levels_it_spans():
    topo = Topology(_cluster())
    # tp-cp-ep-pp-dp: TP 8 in a node, PP 2 in a rack, PP 8 in a zone, DP across zones
    place = topo.placement(8, 1, 2, 16, 1, ORDER_TP_PP_DP)
    assert (place.tp.level, place.tp.tier) == (NODE, 0)
    assert place.pp_tiers[0] == 0 and (place.dp.level, place.dp.tier) == (SITE, 2)
    place = topo.placement(8, 1, 8, 4, 1, ORDER_TP_PP_DP)
    assert max(place.pp_tiers[:-1]) == 1 and place.dp.tier == 2
    # the default order puts PP outermost: PP 4 across zones, DP 8 inside a zone
    place = topo.placement(8, 1, 4, 8, 1, ORDER_DEFAULT)
    assert max(place.pp_tiers[:-1]) == 2 and place.dp.tier == 1


def test_crossing_an_oversubscribed_zone_costs_what_its_uplinks_allow():
    free = _cluster()
    data = copy.deepcopy(BASE)
    data["site"]["domains"][1]["oversubscription"] = 1
    flat = cluster_from_dict(data, "flat.yaml")
    m = PRESETS["llama-70b"]
    layout = Layout(tp=8, cp=1, pp=2, vp=1, dp=16, micro_batch=1, recompute="selective",
                    sequence_parallel=True, order=ORDER_TP_PP_DP)  # fmt: skip
    slow = Evaluator(m, free, 4096, 512).predict(layout)
    fast = Evaluator(m, flat, 4096, 512).predict(layout)
    # only the data-parallel reduction crosses zones, four times oversubscribed
    assert slow.parts["dp comm"] > 3 * fast.parts["dp comm"]
    assert slow.parts["compute"] == fast.parts["compute"]
    net = Evaluator(m, free, 4096, 512).net
    assert net.tier_oversubscription == [1.0, 1.0, 4.0]
    assert net.tier_latency == pytest.approx([5e-6, 7e-6, 12e-6])


def test_a_site_without_domains_plans_as_before():
    data = copy.deepcopy(BASE)
    del data["site"]["domains"]
    plain = cluster_from_dict(data, "plain.yaml")
    data["site"]["domains"] = [{"name": "rack", "nodes": 2}]  # no oversubscription, no latency
    racked = cluster_from_dict(data, "racked.yaml")
    a = plan(PRESETS["llama-70b"], plain, 4096, 512)
    b = plan(PRESETS["llama-70b"], racked, 4096, 512)
    assert [p.step for p in a.ranked[:20]] == [p.step for p in b.ranked[:20]]


def test_the_plan_shows_where_each_group_sits(capsys, tmp_path):
    from porting.cli import main

    path = tmp_path / "zoned.yaml"
    path.write_text(yaml.safe_dump(BASE))
    out = tmp_path / "emit"
    argv = ["plan", "--model", "llama-70b", "--cluster", str(path), "--global-batch", "512"]
    argv += ["--seq-length", "4096", "--layout", "tp=8,pp=2,mb=1", "--emit", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.strip().startswith("groups:"))
    assert "TP8 inside a node" in line and "PP2 across nodes of a rack" in line
    assert "DP16 across zones (1:4 oversubscribed)" in line
    hosts = (out / "hosts.example").read_text().splitlines()
    assert hosts[2:5] == ["dc-zone000-rack000-node000", "dc-zone000-rack000-node001",
                          "dc-zone000-rack001-node002"]  # fmt: skip
    assert hosts[-1] == "dc-zone003-rack015-node031"
    # the scripts' default host names are the template's
    assert "${DC_1:-dc-zone000-rack000-node001}" in (out / "nccl_tests.sh").read_text()
    assert (
        "# dc-zone003-rack015-node031 (site dc, node 31)"
        in (out / "torchrun_per_node.txt").read_text()
    )


def test_tp_stays_inside_the_fastest_domain_and_groups_widen_outward():
    # the rank order puts TP innermost, then CP/EP, PP and DP: each group spans at least the
    # levels of the one inside it, for every layout the search keeps
    c = load_cluster(EXAMPLES / "racks-zones.yaml")
    result = plan(PRESETS["llama3.1-405b"], c, 8192, 3072, Settings(overlap_grad_reduce=True))
    ev = Evaluator(PRESETS["llama3.1-405b"], c, 8192, 3072, result.settings)
    for p in result.ranked[:50]:
        lay = p.layout
        place = ev.topology.placement(lay.tp, lay.cp, lay.pp, lay.dp, lay.instances, p.order)
        assert place.tp.level == NODE
        if p.order == ORDER_TP_PP_DP:
            span = [(place.tp.level, place.tp.tier), (place.cp.level, place.cp.tier)]
            if lay.pp > 1:
                span.append((max(lv for lv, _ in place.pp_boundaries), max(place.pp_tiers[:-1])))
            span.append((place.dp.level, place.dp.tier))
            assert span == sorted(span), (lay.label(), span)


@pytest.mark.parametrize(
    "domains, problem",
    [
        ([{"name": "rack", "nodes": 3}], "a rack of 3 nodes does not divide site dc's 32 nodes"),
        (
            [{"name": "rack", "nodes": 4}, {"name": "zone", "nodes": 6}],
            "a zone of 6 nodes does not hold whole racks of 4 nodes",
        ),
        (
            [{"name": "rack", "nodes": 4}, {"name": "zone", "nodes": 4}],
            "a zone of 4 nodes does not hold whole racks",
        ),
        ([{"name": "rack", "nodes": 64}], "a rack of 64 nodes does not divide site dc's 32"),
        ([{"name": "rack", "nodes": 2}, {"name": "rack", "nodes": 4}], "a second level named"),
        ([{"name": "node", "nodes": 2}], "a second level named 'node'"),
        ([{"name": "rack", "nodes": 2, "oversubscription": 0.5}], "must be at least 1"),
        ([{"name": "rack", "nodes": 2, "oversubscription": 1e9}], "more than the planner's"),
        ([{"name": "rack", "nodes": 1 << 40}], "more than the planner's limit"),
        ([{"name": "r k", "nodes": 2}], "is not a name the planner takes"),
        ({"rack": 2}, "expected a list of domains"),
        (
            [{"name": "rack", "nodes": 2, "latency_us": 1}],
            "1 us to leave a rack is less than the 5",
        ),
        (
            [
                {"name": "rack", "nodes": 2, "latency_us": 9},
                {"name": "zone", "nodes": 8, "latency_us": 8},
            ],
            "latencies grow outward",
        ),
        ([{"name": f"l{i}", "nodes": 2**i} for i in range(1, 11)], "more than the planner's"),
    ],
)
def test_inconsistent_domains_are_refused_by_field(domains, problem):
    with pytest.raises(PortingError, match=problem) as err:
        _cluster(domains=domains)
    assert "zoned.yaml: site.domains" in str(err.value)


def test_per_site_domains_override_the_top_level(tmp_path):
    data = copy.deepcopy(BASE)
    data["sites"].append(
        {"name": "dc2", "nodes": 6, "gpus_per_node": 8,
         "site": {"domains": [{"name": "rack", "nodes": 3}]}}
    )  # fmt: skip
    data["links"] = [{"sites": ["dc", "dc2"], "bandwidth_gbit_s": 400, "distance_km": 10}]
    c = cluster_from_dict(data, "two.yaml")
    assert [d.name for d in c.sites[1].domains] == ["rack"]
    topo = Topology(c)
    # dc has 4 zones of 4 racks, dc2 one level of 2 racks: numbered apart
    assert len(set(topo.domain_of[0].tolist())) == 16 + 2
    assert len(set(topo.domain_of[1].tolist())) == 4 + 1


def test_the_one_site_reference_does_not_depend_on_which_site_has_racks():
    data = copy.deepcopy(BASE)
    plain = {"name": "p", "nodes": 32, "gpus_per_node": 8, "site": {"domains": []}}
    data["sites"].append(plain)
    data["links"] = [{"sites": ["dc", "p"], "bandwidth_gbit_s": 400, "distance_km": 10}]
    first = cluster_from_dict(data, "a.yaml")
    data["sites"].reverse()
    second = cluster_from_dict(data, "b.yaml")
    assert first.one_site().sites[0].domains == second.one_site().sites[0].domains == ()
