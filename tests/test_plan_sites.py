"""The placement search: which parallel dimension crosses the inter-site links.

The default plan must be the fastest the planner predicts under every placement it covers (both
Megatron rank orders, every order of the sites the links allow, uneven pipeline splits), what it
emits must follow the placement, and an uneven split must be one Megatron-Core's own config and
layer builder accept.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from porting.cli import main
from porting.errors import PortingError
from porting.planner import load_cluster, plan
from porting.planner.cluster import cluster_from_dict
from porting.planner.model import PRESETS
from porting.planner.perf import Settings
from porting.planner.placement import ORDER_DEFAULT, ORDER_TP_PP_DP
from porting.planner.search import uneven_split

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
H100 = {"name": "H100", "peak_bf16_tflops": 989, "memory_gib": 80, "hbm_tbytes_s": 3.35}


def _three_equal_sites() -> dict:
    """Three sites of 32 GPUs in a line of RDMA links, the third link slow TCP: PP 3 (and 6)
    puts whole stages in sites, and 32 layers do not split evenly over 3 or 6 stages."""
    return {
        "name": "three-equal",
        "gpu": H100,
        "node": {"bandwidth_gbytes_s": 450, "latency_us": 3},
        "site": {"bandwidth_gbit_s": 400, "latency_us": 5},
        "sites": [{"name": n, "nodes": 4, "gpus_per_node": 8} for n in ("x", "y", "z")],
        "links": [
            {"sites": ["x", "y"], "bandwidth_gbit_s": 100, "distance_km": 50},
            {"sites": ["y", "z"], "bandwidth_gbit_s": 100, "distance_km": 50},
            {"sites": ["z", "x"], "bandwidth_gbit_s": 10, "rtt_ms": 4, "transport": "tcp"},
        ],
    }


CLUSTERS = {
    "two-sites": lambda: load_cluster(EXAMPLES / "two-sites.yaml"),
    "three-sites": lambda: load_cluster(EXAMPLES / "three-sites.yaml"),
    "three-equal": lambda: cluster_from_dict(_three_equal_sites()),
}


@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("model", ["llama-70b", "llama-13b"])
@pytest.mark.parametrize("batch", ["small", "large"])
def test_the_default_plan_is_the_fastest_under_every_placement(cluster_name, model, batch):
    """Searched separately, each rank order (and without uneven splits) finds nothing faster than
    the default search's choice, and the best of each placement it reports is that search's."""
    cluster = CLUSTERS[cluster_name]()
    # global batches 512 and 1024; 384 and 768 where data parallelism comes in threes
    global_batch = {"small": 512, "large": 1024}[batch] * (3 if "equal" in cluster_name else 4) // 4
    m = PRESETS[model]
    chosen = plan(m, cluster, 4096, global_batch)
    alone = {
        order: plan(m, cluster, 4096, global_batch, Settings(orders=(order,)))
        for order in (ORDER_TP_PP_DP, ORDER_DEFAULT)
    }
    even = plan(m, cluster, 4096, global_batch, Settings(uneven_pipeline=False))
    for other in [*alone.values(), even]:
        assert chosen.best.step <= other.best.step * (1 + 1e-12), other.best.layout.label()
    assert chosen.best.step == min(p.step for p in chosen.placements)
    by_label = {p.layout.placement_label(): p.step for p in chosen.placements}
    assert by_label["data-parallel across sites"] == pytest.approx(alone[ORDER_TP_PP_DP].best.step)
    pipeline = [v for k, v in by_label.items() if k.startswith("pipeline")]
    staged = [p.step for p in alone[ORDER_DEFAULT].ranked if p.layout.pp > 1]
    assert min(pipeline) == pytest.approx(min(staged))


def test_site_orders_are_the_linked_permutations_up_to_reversal():
    three = load_cluster(EXAMPLES / "three-sites.yaml")
    assert three.site_orders() == [("a", "b", "c"), ("a", "c", "b"), ("b", "a", "c")]
    two = load_cluster(EXAMPLES / "two-sites.yaml")
    assert two.site_orders() == [("a", "b")]
    with pytest.raises(PortingError, match="expected each of a, b, c once"):
        three.reordered(("a", "b"))


@pytest.mark.parametrize("layers, pp, split", [(32, 3, (11, 11, 10)), (32, 6, (4, 6, 4)),
                                               (81, 2, (41, 0, 40)), (32, 4, None),
                                               (5, 4, None)])  # fmt: skip
def test_uneven_split(layers, pp, split):
    assert uneven_split(layers, pp) == split
    if split:
        first, mid, last = split
        assert (
            first + mid * (pp - 2) + last == layers and last <= first and first <= max(mid, first)
        )


def test_uneven_splits_are_what_megatron_builds():
    """Every uneven split the search ranks goes through Megatron-Core's TransformerConfig checks
    and its get_num_layers_to_build gives each stage the layers the planner predicted with."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    cluster = cluster_from_dict(_three_equal_sites())
    m = PRESETS["llama-7b"]
    result = plan(m, cluster, 4096, 192)
    uneven = [p for p in result.ranked if p.layout.first_layers]
    assert uneven, "no uneven split ranked"
    seen = set()
    for p in uneven:
        lay = p.layout
        key = (lay.pp, lay.first_layers, lay.last_layers)
        if key in seen:
            continue
        seen.add(key)
        cfg = TransformerConfig(
            num_layers=m.layers,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=lay.pp,
            num_layers_in_first_pipeline_stage=lay.first_layers,
            num_layers_in_last_pipeline_stage=lay.last_layers,
            pipeline_dtype=torch.float32,
        )
        built = [get_num_layers_to_build(cfg, pp_rank=r) for r in range(lay.pp)]
        assert built == lay.stage_layers(m.layers), lay.label()
    assert {k[0] for k in seen} >= {3}


def test_an_uneven_split_costs_its_largest_stage():
    """Same layout, the split given by hand: a stage with more layers sets the pace."""
    cluster = cluster_from_dict(_three_equal_sites())
    m = PRESETS["llama-7b"]
    result = plan(m, cluster, 4096, 192)
    p = next(p for p in result.ranked if p.layout.pp == 3 and p.layout.first_layers)
    from porting.planner.perf import Evaluator

    ev = Evaluator(m, cluster, 4096, 192, result.settings, result.eff)
    worse = replace(p.layout, first_layers=6, middle_layers=16, last_layers=10)
    assert ev.predict(worse).step > ev.predict(p.layout).step


def test_emitted_files_follow_the_placement(tmp_path, capsys):
    """The three-site choice puts stages across sites in the order a > b > c: the train flags
    leave the tp-pp-dp mapping off, hosts and torchrun ranks go in that site order, and the plan
    records the placement; an uneven choice emits Megatron's first/last stage flags."""
    out = tmp_path / "emit"
    argv = ["plan", "--model", "llama-70b", "--cluster", str(EXAMPLES / "three-sites.yaml")]
    argv += ["--global-batch", "1024", "--seq-length", "4096", "--emit", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    flags = (out / "train_flags.txt").read_text().split()
    assert "--use-tp-pp-dp-mapping" not in flags
    saved = json.loads((out / "plan.json").read_text())["layouts"][0]
    assert saved["rank_order"] == ORDER_DEFAULT and saved["site_order"] == ["a", "b", "c"]
    hosts = [x for x in (out / "hosts.example").read_text().splitlines() if not x.startswith("#")]
    assert hosts[0].startswith("a-") and hosts[16].startswith("b-") and hosts[32].startswith("c-")

    cfile = tmp_path / "three-equal.yaml"
    import yaml

    cfile.write_text(yaml.safe_dump(_three_equal_sites()))
    out2 = tmp_path / "uneven"
    argv = ["plan", "--model", "llama-7b", "--cluster", str(cfile), "--global-batch", "192"]
    argv += ["--seq-length", "4096", "--layout", "tp=8,pp=3,cp=1,mb=1,order=default,sites=x>y>z"]
    argv += ["--emit", str(out2)]
    assert main(argv) == 0
    capsys.readouterr()
    flags = (out2 / "train_flags.txt").read_text().split()
    i = flags.index("--first-stage-layers")
    assert flags[i : i + 4] == ["--first-stage-layers", "11", "--last-stage-layers", "10"]
    assert "num_layers_in_first_pipeline_stage=11" in (out2 / "strategy.py").read_text()
    # a site order whose neighbours have no link is refused by name
    bad = _three_equal_sites()
    bad["links"] = bad["links"][:2]
    bad["sites"] = [bad["sites"][0], bad["sites"][2], bad["sites"][1]]
    with pytest.raises(PortingError, match="no link between sites"):
        cluster_from_dict(bad)


@pytest.mark.parametrize(
    "layout, needle",
    [
        ("pp=8,order=default,sites=a>q>c", "expected each of a, b, c once"),
        ("pp=8,sites=a>b>c", "sites= only applies with order=default"),
        ("pp=8,order=sideways", "order must be tp-pp-dp or default"),
    ],
)
def test_a_bad_placement_in_layout_is_refused_by_name(layout, needle, capsys):
    argv = ["plan", "--model", "llama-70b", "--cluster", str(EXAMPLES / "three-sites.yaml")]
    argv += ["--global-batch", "1024", "--seq-length", "4096", "--layout", layout]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
