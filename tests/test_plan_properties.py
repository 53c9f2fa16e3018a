"""Properties of the planner over random clusters, models and batches (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from porting.errors import PortingError
from porting.planner import cluster_from_dict, plan
from porting.planner.cluster import Cluster
from porting.planner.model import ModelShape

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def clusters(draw, min_sites: int = 1) -> Cluster:
    n_sites = draw(st.integers(min_sites, 3))
    gpn = draw(st.sampled_from([2, 4, 8]))
    nodes = draw(st.integers(1, 3))
    sites = [
        {"name": f"s{i}", "nodes": draw(st.sampled_from([nodes, 2 * nodes])), "gpus_per_node": gpn}
        for i in range(n_sites)
    ]
    names = [s["name"] for s in sites]
    pairs = list(zip(names, names[1:], strict=False)) + (
        [(names[-1], names[0])] if n_sites > 2 else []
    )
    links = []
    for a, b in pairs:
        link = {
            "sites": [a, b],
            "bandwidth_gbit_s": draw(st.sampled_from([10, 100, 400])),
            "count": draw(st.integers(1, 4)),
            "transport": draw(st.sampled_from(["rdma", "tcp"])),
        }
        if draw(st.booleans()):
            link["distance_km"] = draw(st.floats(0, 500))
        else:
            link["rtt_ms"] = draw(st.floats(0.01, 20))
        links.append(link)
    data = {
        "gpu": {
            "peak_bf16_tflops": 989,
            "memory_gib": draw(st.sampled_from([4, 16, 80])),
            "hbm_tbytes_s": 3.35,
        },
        "node": {"bandwidth_gbytes_s": 450, "latency_us": 3},
        "site": {"bandwidth_gbit_s": draw(st.sampled_from([100, 400])), "latency_us": 5},
        "sites": sites,
        "links": links,
    }
    return cluster_from_dict(data, "random")


@st.composite
def models(draw) -> ModelShape:
    heads = draw(st.sampled_from([4, 8, 16]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if heads % d == 0]))
    hidden = heads * draw(st.sampled_from([32, 64, 128]))
    return ModelShape(
        "random",
        hidden=hidden,
        layers=draw(st.sampled_from([2, 4, 6, 8, 12])),
        heads=heads,
        kv_heads=kv,
        ffn=draw(st.integers(hidden, 4 * hidden)),
        vocab=draw(st.sampled_from([1000, 32000])),
        tied=draw(st.booleans()),
        gated=draw(st.booleans()),
    )


batches = st.sampled_from([8, 16, 32, 64])
seqs = st.sampled_from([256, 1024, 4096])


def _steps(cluster, model, seq, gb) -> dict[str, float]:
    try:
        result = plan(model, cluster, seq, gb)
    except PortingError:
        return {}
    return {p.layout.label(): p.step for p in result.ranked}


@FAST
@given(clusters(min_sites=2), models(), seqs, batches, st.floats(1.01, 10))
def test_more_bandwidth_is_never_slower(cluster, model, seq, gb, factor):
    faster = replace(
        cluster, links=tuple(replace(ln, bandwidth=ln.bandwidth * factor) for ln in cluster.links)
    )
    before, after = _steps(cluster, model, seq, gb), _steps(faster, model, seq, gb)
    assert before.keys() == after.keys()
    for label, step in before.items():
        assert after[label] <= step * (1 + 1e-12), label
    if before:
        assert min(after.values()) <= min(before.values()) * (1 + 1e-12)


@FAST
@given(clusters(min_sites=2), models(), seqs, batches, st.floats(0.1, 2000))
def test_longer_distance_is_never_faster(cluster, model, seq, gb, extra_km):
    extra_rtt = 2 * 5e-6 * extra_km
    farther = replace(
        cluster, links=tuple(replace(ln, rtt=ln.rtt + extra_rtt) for ln in cluster.links)
    )
    before, after = _steps(cluster, model, seq, gb), _steps(farther, model, seq, gb)
    assert before.keys() == after.keys()
    for label, step in before.items():
        assert after[label] >= step * (1 - 1e-12), label


@FAST
@given(clusters(), models(), seqs, batches, st.floats(1.01, 8))
def test_more_memory_never_removes_a_feasible_layout(cluster, model, seq, gb, factor):
    bigger = cluster.with_memory(cluster.slowest_gpu().memory_bytes * factor)
    before, after = _steps(cluster, model, seq, gb), _steps(bigger, model, seq, gb)
    assert set(before) <= set(after)


@FAST
@given(
    clusters(),
    models(),
    st.integers(1, 100_000),
    st.integers(1, 5000),
    st.sampled_from([1, 8, 64, 128]),
)
def test_infeasible_requests_get_a_reason_not_a_crash(cluster, model, seq, gb, layers_scale):
    big = replace(model, layers=model.layers * layers_scale)
    try:
        result = plan(big, cluster, seq, gb)
    except PortingError as err:
        assert "fits nowhere" in str(err) and str(big.name) in str(err)
        return
    assert result.ranked and all(p.step > 0 for p in result.ranked)
    assert all(p.memory.total <= cluster.slowest_gpu().memory_bytes for p in result.ranked)
    for r in result.rejected:
        assert r.reason


def test_a_model_too_big_for_every_layout_names_memory():
    cluster = cluster_from_dict(
        {
            "gpu": {"peak_bf16_tflops": 989, "memory_gib": 1, "hbm_tbytes_s": 3},
            "node": {"bandwidth_gbytes_s": 450, "latency_us": 3},
            "site": {"bandwidth_gbit_s": 400, "latency_us": 5},
            "sites": [{"name": "x", "nodes": 1, "gpus_per_node": 8}],
        }
    )
    model = ModelShape("huge", 8192, 80, 64, 8, 28672, 32000)
    try:
        plan(model, cluster, 4096, 64)
    except PortingError as err:
        text = str(err)
        assert "fits nowhere" in text and "smallest memory need" in text and "> 1 GiB" in text
    else:
        raise AssertionError("a 70B model cannot fit 8 GPUs of 1 GiB")
