"""Planner formulas against hand-computed values, and the model/cluster loaders."""

from __future__ import annotations

import json
import math

import pytest

from porting.errors import PortingError
from porting.planner.cluster import GIB, MIB, Cluster, Level, Link, NcclSettings, Site, link_rtt
from porting.planner.cluster import GPU as Gpu
from porting.planner.comm import (
    Efficiency,
    Network,
    Path,
    allreduce,
    reduce_scatter,
    ring_allreduce,
    tree_allreduce,
)
from porting.planner.model import PRESETS, ModelShape, from_hf_config, load_model
from porting.planner.perf import (
    Evaluator,
    Layout,
    Settings,
    inflight_chunks,
    layer_activation_bytes,
    memory,
)
from porting.planner.placement import WAN, GroupShape


def _gpt(h=64, layers=2, heads=4, vocab=1024) -> ModelShape:
    return ModelShape(
        "gpt", h, layers, heads, heads, 4 * h, vocab, tied=True, gated=False,
        layernorm=True, bias=True, learned_positions=16, dropout=True,
    )  # fmt: skip


def test_llama2_parameter_counts_match_the_released_checkpoints():
    # Llama-2-7b-hf and -70b-hf hold exactly these many parameters (safetensors index totals).
    assert PRESETS["llama-7b"].total_params() == 6_738_415_616
    assert PRESETS["llama-70b"].total_params() == 68_976_648_192


@pytest.mark.parametrize("name", ["gpt-1.7b", "gpt-145b", "gpt-1t"])
def test_gpt_parameters_are_narayanan_eq2_plus_the_final_layernorm(name):
    m = PRESETS[name]
    h, lay, v, s = m.hidden, m.layers, m.vocab, 2048
    eq2 = 12 * lay * h * h + 13 * lay * h + (v + s) * h
    assert m.total_params() == eq2 + 2 * h


@pytest.mark.parametrize("name", ["gpt-1.7b", "gpt-18b", "gpt-1t"])
def test_flops_per_token_plus_recompute_is_narayanan_eq3(name):
    m = PRESETS[name]
    h, lay, v, s, batch = m.hidden, m.layers, m.vocab, 2048, 512
    eq3 = 96 * batch * s * lay * h * h * (1 + s / (6 * h) + v / (16 * lay * h))
    recompute = 24 * batch * s * lay * h * h * (1 + s / (6 * h))  # one more forward of the layers
    assert m.model_flops_per_token(s) * batch * s + recompute == pytest.approx(eq3, rel=1e-12)


def test_activation_bytes_per_layer_are_korthikanti_table2():
    m = _gpt()
    s, b, h, a = 16, 2, 64, 4
    sbh = s * b * h
    rep, sh = layer_activation_bytes(m, s * b, s, 1, False, scores=True)
    assert rep + sh == 34 * sbh + 5 * a * s * s * b
    rep, sh = layer_activation_bytes(m, s * b, s, 2, False, scores=True)
    assert rep + sh == sbh * (10 + 24 / 2) + 5 * a * s * s * b / 2
    rep, sh = layer_activation_bytes(m, s * b, s, 2, True, scores=True)
    assert rep + sh == (34 * sbh + 5 * a * s * s * b) / 2
    rep, sh = layer_activation_bytes(m, s * b, s, 2, True, scores=False)
    assert rep + sh == 34 * sbh / 2


def test_activation_bytes_gqa_swiglu_by_hand():
    # h 64, 4 heads of 16, 2 KV heads (kv width 32), SwiGLU ffn 96, no dropout, T = 10 tokens
    m = ModelShape("g", 64, 2, 4, 2, 96, 128)
    rep, sh = layer_activation_bytes(m, 10, 10, 1, False, scores=False)
    assert rep == 2 * 10 * 64 * 2 + 2 * 10 * 64 + 2 * 10 * 64  # 2 norm inputs, qkv in, fc1 in
    assert sh == 2 * 10 * (64 + 32) + 2 * 10 * 32 + 2 * 10 * 64 + 2 * 10 * 192 + 2 * 10 * 96


def test_inflight_microbatches_follow_megatron_schedules():
    assert [inflight_chunks(4, 1, r, 100) for r in range(4)] == [4, 3, 2, 1]
    assert [inflight_chunks(4, 1, r, 2) for r in range(4)] == [2, 2, 2, 1]
    # interleaved warm-up: 2 (p - rank - 1) + (v - 1) p chunks, plus the one in flight
    assert inflight_chunks(4, 2, 0, 100) == 2 * 3 + 1 * 4 + 1
    assert inflight_chunks(4, 2, 3, 100) == 0 + 4 + 1
    assert inflight_chunks(1, 1, 0, 7) == 1


def test_weights_grads_optimizer_bytes_by_hand():
    m = ModelShape("g", 64, 4, 4, 2, 96, 256)
    lay = Layout(tp=2, cp=1, pp=2, vp=1, dp=4, micro_batch=1, recompute="full", instances=2)
    s = Settings(reserve_bytes=0)
    first = memory(m, lay, 32, 8, s, 0)
    per_layer = m.params_per_layer()
    params = 2 * per_layer / 2 + 256 * 64 / 2  # two layers over TP 2, and the embedding
    assert first.weights == 2 * params
    assert first.grads == 4 * params
    assert first.optimizer == 12 * params / (4 // 2)  # sharded over DP / instances


def test_collectives_alpha_beta_by_hand():
    p = Path(bandwidth=1e10, latency=1e-5, level=1)
    assert ring_allreduce(4, 1e9, p) == pytest.approx(6e-5 + 1.5 * 0.1)
    assert tree_allreduce(4, 1e9, p) == pytest.approx(4e-5 + 0.2)
    assert allreduce(4, 1e9, p) == pytest.approx(6e-5 + 0.15)  # ring wins on bandwidth
    assert allreduce(4, 8, p) == pytest.approx(tree_allreduce(4, 8, p))  # tree on latency
    assert reduce_scatter(4, 1e9, p) == pytest.approx(3e-5 + 0.75 * 0.1)
    assert ring_allreduce(1, 1e9, p) == 0.0


def test_fibre_rtt_is_five_microseconds_per_km_each_way():
    assert link_rtt(30, 5e-6) == pytest.approx(2 * (30 * 5e-6 + 5e-6))


def _two_sites(transport="rdma", rtt=0.01, count=1, nccl=None, link_bw=50e9) -> Cluster:
    gpu = Gpu("g", 1e15, 80 * GIB, 3e12)
    site = Site("a", 2, 8, gpu, Level(400e9, 3e-6), Level(50e9, 5e-6))
    link = Link("a", "b", link_bw, count, rtt, transport)
    return Cluster(
        "t", (site, Site("b", 2, 8, gpu, site.node, site.net)), (link,), nccl or NcclSettings()
    )


def test_nccl_window_caps_a_long_link():
    c = _two_sites(rtt=0.01)
    eff = Efficiency()
    share, nccl = Network(c, eff, tune=False).link_share(c.links[0], 1)
    assert nccl.buffsize == 4 * MIB
    assert share == pytest.approx(2 * 4 * MIB / 0.01)  # channels x NCCL_BUFFSIZE / RTT
    share, nccl = Network(c, eff, tune=True).link_share(c.links[0], 1)
    assert nccl.buffsize == 64 * MIB  # the bandwidth-delay product needs more than the ceiling
    assert share == pytest.approx(2 * 64 * MIB / 0.01)
    near = _two_sites(rtt=1e-4)
    share, _ = Network(near, eff, tune=False).link_share(near.links[0], 1)
    assert share == pytest.approx(min(50e9 * eff.wan_rdma, 50e9 * eff.site_bw))


def test_tcp_link_has_its_own_efficiency_and_ecmp_needs_streams():
    eff = Efficiency()
    rdma = _two_sites("rdma", rtt=1e-4, count=4, link_bw=10e9)
    tcp = _two_sites("tcp", rtt=1e-4, count=4, link_bw=10e9)
    flows = 64
    s_rdma, _ = Network(rdma, eff, tune=False).link_share(rdma.links[0], flows)
    s_tcp, _ = Network(tcp, eff, tune=False).link_share(tcp.links[0], flows)
    assert s_tcp / s_rdma == pytest.approx(eff.wan_tcp / eff.wan_rdma)
    # one flow with one queue pair hashes onto one of the four links
    one, _ = Network(rdma, eff, tune=False).link_share(rdma.links[0], 1)
    assert one == pytest.approx(10e9 * eff.wan_rdma)
    four, nccl = Network(rdma, eff, tune=True).link_share(rdma.links[0], 1)
    assert nccl.qps_per_connection == 4
    assert four == pytest.approx(4 * 10e9 * eff.wan_rdma)


def test_group_path_uses_the_slowest_level():
    c = _two_sites(rtt=1e-4)
    net = Network(c, Efficiency(), tune=False)
    g = GroupShape(size=4, level=WAN, members_per_node=1, links=c.links, count=16)
    p = net.path(g)
    assert p.level == WAN
    assert p.bandwidth == pytest.approx(50e9 * 0.9 / 16)
    assert p.latency == pytest.approx(1e-4 / 2 + 5e-6)


def test_bubble_halves_with_two_virtual_stages():
    m = ModelShape("g", 256, 8, 8, 8, 1024, 512)
    c = _two_sites(rtt=1e-4)
    ev = Evaluator(m, Cluster("one", (c.sites[0],)), 256, 64)
    base = dict(tp=2, cp=1, pp=4, dp=2, micro_batch=1, recompute="none")
    one = ev.predict(Layout(vp=1, **base))
    two = ev.predict(Layout(vp=2, **base))
    assert two.parts["bubble"] == pytest.approx(one.parts["bubble"] / 2)
    assert sum(one.parts.values()) == pytest.approx(one.step)


def test_hf_llama_config_fields():
    cfg = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 97,
        "vocab_size": 130,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    m = from_hf_config(cfg)
    assert (m.hidden, m.layers, m.heads, m.kv_heads, m.ffn, m.vocab) == (64, 2, 4, 2, 97, 130)
    assert m.tied and m.gated and m.head_dim == 16
    cfg.pop("num_key_value_heads")
    assert from_hf_config(cfg).kv_heads == 4
    cfg.pop("intermediate_size")
    with pytest.raises(PortingError, match="intermediate_size"):
        from_hf_config(cfg, "x/config.json")


@pytest.mark.parametrize(
    "extra, kv, norms, parallel",
    [
        ({"multi_query": True, "parallel_attn": True}, 1, 1, True),  # 7B
        ({"new_decoder_architecture": True, "num_kv_heads": 2}, 2, 2, True),  # 40B
        (
            {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1},
            2,
            1,
            True,
        ),  # 11B
        ({"multi_query": False, "parallel_attn": False, "alibi": True}, 4, 2, False),  # RW
    ],
)
def test_hf_falcon_variants_by_config_fields(extra, kv, norms, parallel):
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}
    m = from_hf_config({"architectures": ["FalconForCausalLM"], **cfg, **extra})
    assert (m.kv_heads, m.norms_per_layer, m.parallel_attn) == (kv, norms, parallel)
    assert m.ffn == 256 and not m.gated and m.layernorm


def test_load_model_from_checkpoint_config_and_preset(tmp_path):
    cfg = {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 300,
        "vocab_size": 1000,
    }
    ckpt = tmp_path / "ckpt"
    (ckpt / "context").mkdir(parents=True)
    (ckpt / "context" / "porting.json").write_text(json.dumps({"hf_config": cfg}))
    assert load_model(ckpt).ffn == 300
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(cfg))
    assert load_model(hf).kv_heads == 4
    assert load_model(hf / "config.json").layers == 4
    assert load_model("llama-13b").hidden == 5120
    with pytest.raises(PortingError, match="presets"):
        load_model(tmp_path / "missing")
    (ckpt / "context" / "porting.json").write_text(json.dumps({"family": "x"}))
    with pytest.raises(PortingError, match="hf_config"):
        load_model(ckpt)


def test_model_flops_scale_with_gqa_and_swiglu():
    m = PRESETS["llama-70b"]
    per_layer = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672
    assert m.matmul_params_per_layer() == per_layer
    expect = 80 * (6 * per_layer + 12 * 4096 * 8192) + 6 * 8192 * 32000
    assert m.model_flops_per_token(4096) == expect
    assert math.isclose(m.model_flops_per_token(4096) / (6 * m.total_params()), 1.1, rel_tol=0.1)


@pytest.mark.parametrize("field", ["num_local_experts", "num_experts", "n_routed_experts"])
def test_a_mixture_of_experts_config_is_planned_as_moe_not_as_dense(field):
    from porting.planner.model import from_hf_config

    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 100, "intermediate_size": 96, field: 8, "num_experts_per_tok": 2}  # fmt: skip
    m = from_hf_config(cfg, "config.json")
    assert (m.experts, m.top_k, m.moe_ffn, m.moe_layers) == (8, 2, 96, 2)
    dense = from_hf_config({k: v for k, v in cfg.items() if k != field}, "config.json")
    # FLOPs count the 2 routed experts, memory all 8
    mlp = 3 * 64 * 96
    assert m.matmul_params_per_layer() - dense.matmul_params_per_layer() == mlp + 64 * 8
    assert m.params_per_layer() - dense.params_per_layer() == 7 * mlp + 64 * 8
