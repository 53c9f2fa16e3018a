"""The planner for mixture-of-experts models: configs read, the all-to-all model against DeepEP's
published tables, MoE Parallel Folding's published MFU, EP in the search, the placement and the
emitted flags, and the refusals (docs/planner.md, "Mixture of experts")."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from porting.errors import PortingError
from porting.planner.alltoall import deduplicated_time, per_copy_time, routing_spread
from porting.planner.cluster import load_cluster
from porting.planner.comm import Efficiency
from porting.planner.limits import MAX_LAYOUTS
from porting.planner.model import PRESETS, from_hf_config
from porting.planner.perf import Evaluator, Layout, Settings
from porting.planner.placement import NODE, ORDER_DEFAULT, ORDER_TP_PP_DP, SITE
from porting.planner.search import plan, search_size
from porting.testing import h100_cluster

# docs/planner.md "Mixture of experts": the band every published figure is reproduced within
BAND = 0.15
EFF = Efficiency()

# DeepEP (deepseek-ai/DeepEP, docs/legacy.md, V1 tables; H800: NVLink ~160 GB/s, CX7 400 Gb/s
# ~50 GB/s; 7168 hidden, top-8 of 256 experts, FP8 dispatch, BF16 combine).
NVLINK = 160e9 * EFF.a2a_node_bw
RDMA = 50e9 * EFF.site_bw
HIDDEN = 7168
FP8 = HIDDEN * (1 + 4 / 128)  # e4m3 values plus a float scale per 128 (tests/test_internode.py)
BF16 = 2 * HIDDEN
# normal kernels, 4096 tokens per rank, top-4 node groups: (dispatch, combine) GB/s
NORMAL = {8: (153, 158), 16: (43, 43), 32: (58, 57), 64: (51, 50)}
# low-latency kernels, 128 tokens per rank: (dispatch, combine) microseconds
LOW_LATENCY = {
    8: (77, 114),
    16: (118, 195),
    32: (155, 273),
    64: (173, 314),
    128: (192, 369),
    256: (194, 360),
}


@pytest.mark.parametrize("ep", sorted(NORMAL))
def test_deepep_normal_kernels_bandwidth_within_the_band(ep):
    """DeepEP's bottleneck bandwidth as its benchmark counts it: NVLink bytes received inside a
    node (EP 8), and (token, node) pairs x token bytes over RDMA between nodes, the token's own
    node included, per kernel time."""
    nodes = ep // 8
    groups = dict(groups=nodes, group_limit=min(nodes, 4)) if nodes > 1 else {}
    spread = routing_spread(256, 8, ep, 8, **groups)
    for token_bytes, published in zip((FP8, BF16), NORMAL[ep], strict=True):
        t = deduplicated_time(4096, token_bytes, spread, NVLINK, RDMA, EFF.a2a_latency)
        pairs = spread.gpus if nodes == 1 else spread.nodes
        predicted = 4096 * pairs * token_bytes / t / 1e9
        assert abs(predicted / published - 1) < BAND, (ep, predicted, published)


@pytest.mark.parametrize("ep", sorted(LOW_LATENCY))
def test_deepep_low_latency_kernels_within_the_band(ep):
    for token_bytes, published in zip(
        (HIDDEN + HIDDEN / 128 * 4 + 16, BF16), LOW_LATENCY[ep], strict=True
    ):
        t = per_copy_time(128, 8, token_bytes, ep, 8, NVLINK, RDMA, EFF.a2a_latency)
        assert abs(t * 1e6 / published - 1) < BAND, (ep, t * 1e6, published)


def test_routing_spread_counts_what_uniform_routing_reaches():
    # every expert on its own GPU: top-k reaches exactly k GPUs
    assert routing_spread(8, 2, 8, 8).gpus == pytest.approx(2)
    # two nodes of 128 experts, top-8: both nodes unless all 8 land on one
    two = routing_spread(256, 8, 16, 8)
    assert two.nodes == pytest.approx(2 - 2 * 0.5**8, rel=0.01)
    # node-limited routing (DeepSeek-V3: at most 4 of 8 nodes) bounds the nodes a token reaches
    limited = routing_spread(256, 8, 64, 8, groups=8, group_limit=4)
    free = routing_spread(256, 8, 64, 8)
    assert limited.nodes <= 4 < free.nodes
    assert limited.remote_nodes < limited.nodes


# MoE Parallel Folding (Liu et al. 2025, arXiv 2504.14960) Table 3, "MCore w/ Folding": BF16,
# sequence 4096, global batch 256 (appendix 6.4); micro-batch 1 and the virtual stages from
# NVIDIA's Megatron-MoE-ModelZoo runtime.conf (Mixtral VPP 1 at the paper's time, 7 later).
FOLDING = [
    ("mixtral-8x22b", 16, dict(tp=2, pp=8, vp=1, ep=8), 0.493),
    ("mixtral-8x22b", 16, dict(tp=2, pp=8, vp=7, ep=8), 0.493),
    ("qwen2-57b-a14b", 8, dict(tp=2, pp=4, vp=7, ep=4), 0.390),
]


@pytest.mark.parametrize("name, nodes, split, published", FOLDING)
def test_moe_parallel_folding_mfu_within_the_band(tmp_path, name, nodes, split, published):
    cluster = load_cluster(h100_cluster(tmp_path, nodes))
    ev = Evaluator(PRESETS[name], cluster, 4096, 256)
    tp, pp, ep = split["tp"], split["pp"], split["ep"]
    dp = cluster.world // (tp * pp)
    # Megatron's default order (PP outermost): with tp-cp-ep-pp-dp it refuses EP x ETP != TP x CP
    layout = Layout(
        tp=tp, cp=1, pp=pp, vp=split["vp"], dp=dp, micro_batch=1, recompute="none",
        sequence_parallel=True, order=ORDER_DEFAULT, ep=ep, etp=1,
    )  # fmt: skip
    assert layout.edp == tp * dp // ep
    p = ev.predict(layout)
    assert abs(p.mfu / published - 1) < BAND, (name, split, p.mfu, published)
    assert p.parts["ep comm"] > 0


def test_moe_configs_are_read_with_their_published_sizes():
    # total / active parameters from the model cards (billions), and how many of the embedding
    # and the output layer each card's active count holds
    published = {
        "mixtral-8x7b": (46.7, 12.9, 2),
        "mixtral-8x22b": (141, 39, 2),
        "qwen2-57b-a14b": (57, 14, 2),
        "qwen3-235b-a22b": (235, 22, 2),
        "deepseek-v2-lite": (15.7, 2.4, 1),
        "deepseek-v3": (671, 37, 2),
    }
    for name, (total, active, tables) in published.items():
        m = PRESETS[name]
        assert m.moe
        got_active = m.layers * m.matmul_params_per_layer() + tables * m.vocab * m.hidden
        assert m.total_params() / 1e9 == pytest.approx(total, rel=0.02), name
        assert got_active / 1e9 == pytest.approx(active, rel=0.03), name
    v3 = PRESETS["deepseek-v3"]
    assert (v3.moe_layers, v3.kv_lora, v3.head_dim, v3.groups, v3.group_limit) == (
        58,
        512,
        192,
        8,
        4,
    )
    assert v3.shared_ffn == 2048


def test_qwen_sparse_step_and_dense_layers_are_counted():
    cfg = {
        "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 100,
        "intermediate_size": 256, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [1],
    }  # fmt: skip
    m = from_hf_config(cfg)
    # layers 1, 3, 5, 7 are sparse by the step; layer 1 is dense by mlp_only_layers
    assert (m.moe_layers, m.ffn, m.moe_ffn) == (3, 256, 32)
    dense = from_hf_config({k: v for k, v in cfg.items() if "expert" not in k})
    assert not dense.moe


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"num_experts_per_tok": None}, "no num_experts_per_tok"),
        ({"num_experts_per_tok": 9}, "routed to 9 of 8 experts"),
        ({"num_experts": 1 << 40}, "num_experts: .* more than the planner's limit"),
        ({"num_experts": [[1]] * 100}, "num_experts: expected an integer"),
        ({"mlp_only_layers": ["x"]}, "mlp_only_layers: 'x' is not a layer index"),
        ({"mlp_only_layers": list(range(4))}, "no layer is a mixture-of-experts layer"),
        ({"n_group": 3, "topk_group": 1}, "n_group 3 must divide the 8 experts"),
        ({"n_group": 8, "topk_group": 1}, "top-2 cannot come from 1 groups of 1"),
        # layer placements the reader does not know (Jamba, Llama 4) and hybrid layers
        ({"expert_layer_period": 2, "expert_layer_offset": 1}, "expert_layer_period: the planner"),
        ({"interleave_moe_layer_step": 2}, "interleave_moe_layer_step: the planner does not"),
        ({"layer_types": ["linear_attention"] * 4}, "'linear_attention' layers are not"),
        (
            {"architectures": ["FalconForCausalLM"], "multi_query": True},
            "a Falcon-layout config with experts",
        ),
    ],
)
def test_bad_moe_configs_are_refused_by_name(change, problem):
    cfg = {
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100,
        "intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 2,
    }  # fmt: skip
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(PortingError, match=problem):
        from_hf_config(cfg, "config.json")


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b"])
@pytest.mark.parametrize("cluster", ["two-sites.yaml", "h800-2048.yaml", "racks-zones.yaml"])
def test_frontier_moe_models_are_planned_with_ep_placed_and_explained(name, cluster):
    c = load_cluster(Path("examples/clusters") / cluster)
    result = plan(PRESETS[name], c, 4096, {256: 1024, 2048: 4096}.get(c.world, 6144))
    best = result.best
    note = next(n for n in result.notes if n.startswith("expert parallelism"))
    ev = Evaluator(PRESETS[name], c, 4096, result.global_batch)
    lay = best.layout
    if lay.ep > 1:
        place = ev.topology_for(lay.sites).placement(
            lay.tp, lay.cp, lay.pp, lay.dp, lay.instances, best.order, lay.ep, lay.etp
        )
        # inside a node unless the note says a wider group is faster
        assert place.ep.level == NODE or "predicted faster" in note
        assert lay.edp * lay.ep * lay.etp == lay.tp * lay.cp * lay.dp
    assert result.considered <= MAX_LAYOUTS


def test_an_ep_group_wider_than_a_node_is_placed_across_the_site(tmp_path):
    cluster = load_cluster(h100_cluster(tmp_path, 16))
    ev = Evaluator(PRESETS["deepseek-v3"], cluster, 4096, 1024)
    place = ev.topology.placement(1, 1, 2, 64, 1, ORDER_TP_PP_DP, 64, 1)
    # EP 64 with ETP 1 is 64 consecutive ranks: 8 nodes of 8 inside the site
    assert (place.ep.level, place.ep.members_per_node, place.ep.size) == (SITE, 8, 64)
    assert place.etp.size == 1 and place.edp.size == 1
    # ETP varies fastest in the expert grid: EP 4 x ETP 2 fills one node, EP 8 x ETP 2 two
    place = ev.topology.placement(2, 1, 1, 64, 1, ORDER_TP_PP_DP, 4, 2)
    assert (place.ep.level, place.ep.size, place.etp.size, place.edp.size) == (NODE, 4, 2, 16)
    place = ev.topology.placement(2, 1, 1, 64, 1, ORDER_TP_PP_DP, 8, 2)
    assert (place.ep.level, place.ep.members_per_node) == (SITE, 4)


def test_the_search_over_experts_stays_within_its_budget():
    # the largest cluster file and the model with the most EP choices: the count that bounds
    # the search's time (scripts/bench_plan.py measures it)
    c = load_cluster(Path("examples/clusters/h800-2048.yaml"))
    ev = Evaluator(PRESETS["deepseek-v3"], c, 4096, 15360)
    fixed, per_order = search_size(ev)
    assert fixed + per_order <= MAX_LAYOUTS
    start = time.process_time()
    plan(PRESETS["deepseek-v3"], c, 4096, 15360, Settings(expert_parallel=(8, 64)))
    # not a speed target: a search whose work blew up would take minutes, not seconds
    assert time.process_time() - start < 60


def _run(argv, capsys):
    from porting.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_flags_for_experts(tmp_path, capsys):
    base = ["plan", "--cluster", str(h100_cluster(tmp_path, 16)), "--global-batch", "256"]
    base += ["--seq-length", "4096"]
    code, _, err = _run([*base, "--model", "mixtral-8x22b", "--ep", "3"], capsys)
    assert code == 2 and "--ep 3 does not divide the 8 experts of model mixtral-8x22b" in err
    code, _, err = _run([*base, "--model", "mixtral-8x22b", "--ep", "256"], capsys)
    assert code == 2 and "--ep 256" in err
    code, _, err = _run([*base, "--model", "llama-70b", "--ep", "8"], capsys)
    assert code == 2 and "model llama-70b has no experts" in err
    code, _, err = _run([*base, "--model", "llama-70b", "--layout", "tp=8,pp=4,ep=2,mb=1"], capsys)
    assert code == 2 and "has no experts" in err


def test_emitted_flags_are_what_porting_train_accepts(tmp_path, capsys):
    from porting.cli import build_parser

    out = tmp_path / "emit"
    argv = ["plan", "--model", "mixtral-8x22b", "--cluster", str(h100_cluster(tmp_path, 16))]
    argv += ["--global-batch", "256", "--seq-length", "4096", "--emit", str(out), "--json"]
    argv += ["--layout", "tp=2,pp=8,ep=8,etp=1,mb=1,recompute=none,order=default"]
    code, text, _ = _run(argv, capsys)
    assert code == 0
    chosen = json.loads(text)["chosen"]
    assert (chosen["layout"]["ep"], chosen["layout"]["etp"]) == (8, 1)
    flags = (out / "train_flags.txt").read_text().split()
    assert flags[flags.index("--ep") + 1] == "8" and flags[flags.index("--etp") + 1] == "1"
    args = build_parser().parse_args(["train", *[f.strip('"') for f in flags]])
    assert (args.ep, args.etp, args.tp, args.pp) == (8, 1, 2, 8)
    strategy = (out / "strategy.py").read_text()
    for text in (
        "expert_model_parallel_size=8,",
        "expert_tensor_parallel_size=1,",
        "--num-experts 8",
        "--expert-model-parallel-size 8",
        "--expert-tensor-parallel-size 1",
    ):
        assert text in strategy
    compile(strategy, "strategy.py", "exec")
    # the nccl-tests script measures each level's all-to-all too, named as --calibrate reads them
    script = (out / "nccl_tests.sh").read_text()
    assert "alltoall_perf" in script and "nccl-logs/node_alltoall.log" in script
    assert "nccl-logs/site-eos_alltoall.log" in script
    # and the expert GEMMs' benchmark, for --calibrate beside them (tests/test_plan_experts.py)
    assert "GROUPS = 1" in (out / "gemm_bench.py").read_text()
    plan_json = json.loads((out / "plan.json").read_text())
    assert plan_json["model"]["experts"] == 8


def test_dense_plans_carry_no_expert_flags(tmp_path, capsys):
    out = tmp_path / "emit"
    argv = ["plan", "--model", "llama-70b", "--cluster", "examples/clusters/two-sites.yaml"]
    argv += ["--global-batch", "512", "--seq-length", "4096", "--emit", str(out)]
    assert _run(argv, capsys)[0] == 0
    assert "--ep" not in (out / "train_flags.txt").read_text().split()
    assert "expert" not in (out / "strategy.py").read_text()
    assert "alltoall" not in (out / "nccl_tests.sh").read_text()
    assert not (out / "gemm_bench.py").exists()


def test_gpt_oss_sliding_layers_are_attention_layers():
    cfg = {
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100,
        "intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }  # fmt: skip
    assert from_hf_config(cfg).moe_layers == 4


def test_a_huge_grouped_routing_is_counted_without_big_integers():
    # 65,536 experts in 16,384 groups, 8,192 allowed: once minutes of exact binomials per layout
    spread = routing_spread(65536, 8, 8, 8, 16384, 8192)
    assert spread.nodes == 1.0 and spread.remote_nodes == 0.0 and 1 < spread.gpus <= 8
    wide = routing_spread(65536, 8, 64, 8, 16384, 8192)
    assert 1 < wide.nodes <= 8 and wide.remote_nodes < wide.nodes


# model cards' total parameters (billions) of the MoE configs in the published catalogue
CARD_TOTALS = {
    "Qwen/Qwen1.5-MoE-A2.7B": 14.3,
    "Qwen/Qwen3-30B-A3B": 30.5,
    "allenai/OLMoE-1B-7B-0924": 6.9,
    "allenai/OLMoE-1B-7B-0125": 6.9,
    "deepseek-ai/DeepSeek-V2-Lite": 15.7,
    "deepseek-ai/DeepSeek-V3": 671,
    "deepseek-ai/DeepSeek-V3.1": 671,
    "moonshotai/Kimi-K2-Instruct": 1040,
    "moonshotai/Moonlight-16B-A3B": 16,
    "openai/gpt-oss-120b": 117,
    "openai/gpt-oss-20b": 21,
    "mistralai/Mixtral-8x7B-v0.1": 46.7,
    # the model cards' totals: 3.3B and 1.3B (800M and 400M active)
    "ibm-granite/granite-3.0-3b-a800m-base": 3.3,
    "ibm-granite/granite-3.0-1b-a400m-base": 1.3,
}


def _published() -> dict:
    # loaded by path, as tests/test_published.py does: a "tests" package elsewhere may shadow ours
    import importlib.util

    path = Path(__file__).with_name("published_configs.py")
    spec = importlib.util.spec_from_file_location("published_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PUBLISHED


@pytest.mark.parametrize("hub_id", sorted(CARD_TOTALS))
def test_published_moe_configs_are_read_whole(hub_id):
    """Each config as its hub repository ships it, every field included (tests/published_configs.py)."""
    m = from_hf_config(_published()[hub_id], hub_id, hub_id)
    assert m.moe and m.top_k < m.experts
    assert m.total_params() / 1e9 == pytest.approx(CARD_TOTALS[hub_id], rel=0.03)


def test_every_published_moe_config_is_in_the_check():
    keys = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    moe = {h for h, c in _published().items() if any(c.get(k) for k in keys)}
    assert moe == set(CARD_TOTALS)
