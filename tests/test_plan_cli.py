"""`porting plan` end to end: tables and JSON, emitted files, calibration, and bad input."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from porting.cli import main
from porting.planner import cluster_from_dict, load_cluster
from porting.planner.calibrate import NcclTest, predict_test
from porting.planner.comm import Efficiency
from porting.planner.placement import NODE, SITE, WAN

ROOT = Path(__file__).resolve().parents[1]
THREE = ROOT / "examples" / "clusters" / "three-sites.yaml"
ONE = ROOT / "examples" / "clusters" / "dgx-h100-one-site.yaml"
BASE = ["plan", "--model", "llama-70b", "--global-batch", "1024", "--seq-length", "4096"]


def _cluster_yaml(tmp_path: Path, data: dict, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _small_two_sites() -> dict:
    return {
        "name": "two",
        "gpu": {"name": "H100", "peak_bf16_tflops": 989, "memory_gib": 80, "hbm_tbytes_s": 3.35},
        "node": {"bandwidth_gbytes_s": 450, "latency_us": 3},
        "site": {"bandwidth_gbit_s": 400, "latency_us": 5},
        "sites": [
            {"name": "a", "nodes": 2, "gpus_per_node": 8},
            {"name": "b", "nodes": 2, "gpus_per_node": 8},
        ],
        "links": [{"sites": ["a", "b"], "bandwidth_gbit_s": 200, "distance_km": 30}],
    }


def test_table_lists_layouts_memory_comm_and_slowdown(capsys):
    assert main([*BASE, "--cluster", str(THREE), "--top", "3", "--rejected"]) == 0
    out = capsys.readouterr().out
    assert "considered" in out and "feasible" in out
    assert "exposed s node/site/wan" in out and "vs 1 site" in out
    assert "chosen: TP" in out and "x the step time of the same GPUs in one site" in out
    assert "the best layout of each placement" in out and "note: placement:" in out
    assert "data-parallel across sites" in out and "pipeline across sites a>b>c" in out
    assert "rejected (" in out and "does not divide" in out and "GiB" in out


def test_json_has_the_chosen_layout_and_parts(capsys):
    assert main([*BASE, "--cluster", str(ONE), "--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    chosen = data["chosen"]
    assert chosen["label"] == data["layouts"][0]["label"]
    assert chosen["step_s"] == pytest.approx(sum(chosen["parts_s"].values()))
    assert set(chosen["memory_gib"]) >= {"weights", "grads", "optimizer", "activations", "total"}
    assert data["considered"] >= data["feasible"] > 0


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    out = tmp_path_factory.mktemp("launch")
    ckpt = tmp_path_factory.mktemp("ckpt")
    (ckpt / "context").mkdir()
    cfg = {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
    }
    (ckpt / "context" / "porting.json").write_text(json.dumps({"hf_config": cfg}))
    argv = ["plan", "--model", str(ckpt), "--cluster", str(THREE), "--global-batch", "1024"]
    argv += ["--seq-length", "4096", "--layout", "tp=8,pp=4,vp=5,cp=1,mb=1,recompute=selective"]
    argv += ["--emit", str(out), "--data", "/data/corpus_text_document"]
    assert main(argv) == 0
    return out, ckpt


def _train_parser() -> argparse.ArgumentParser:
    from porting.commands import train as train_cli

    parser = argparse.ArgumentParser(prog="porting")
    train_cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_emitted_train_flags_are_accepted_by_porting_train(emitted):
    out, ckpt = emitted
    flags = shlex.split((out / "train_flags.txt").read_text())
    args = _train_parser().parse_args(["train", *flags])
    assert (args.tp, args.pp, args.vp, args.cp) == (8, 4, 5, 1)
    assert args.sequence_parallel and args.use_tp_pp_dp_mapping
    assert args.num_distributed_optimizer_instances == 4
    assert (args.nodes, args.gpus_per_node) == (64, 8)
    assert (args.seq_length, args.micro_batch, args.global_batch) == (4096, 1, 1024)
    assert args.checkpoint == ckpt.resolve() and args.out == Path("$OUT")
    plan = json.loads((out / "plan.json").read_text())
    assert shlex.split(" ".join(plan["train_argv"])) == flags
    assert plan["layouts"][0]["label"].startswith("TP8 PP4 VP5 CP1")


def test_a_megatron_bridge_root_is_planned_and_named_in_the_flags(emitted, tmp_path):
    """A Megatron-Bridge (or Megatron-LM) checkpoint keeps its manifest beside its iterations
    (porting/porting.json): the planner reads the model from it and the flags name it, for
    `porting train --engine bridge`, as a NeMo 2 checkpoint's context/porting.json."""
    _, nemo2 = emitted
    ckpt = tmp_path / "bridge"
    (ckpt / "porting").mkdir(parents=True)
    shutil.copy(nemo2 / "context" / "porting.json", ckpt / "porting" / "porting.json")
    out = tmp_path / "launch"
    argv = ["plan", "--model", str(ckpt), "--cluster", str(THREE), "--global-batch", "1024"]
    argv += ["--seq-length", "4096", "--layout", "tp=8,pp=4,vp=5,cp=1,mb=1,recompute=selective"]
    assert main([*argv, "--emit", str(out), "--data", "/data/corpus_text_document"]) == 0
    args = _train_parser().parse_args(
        ["train", *shlex.split((out / "train_flags.txt").read_text())]
    )
    assert args.checkpoint == ckpt.resolve() and (args.tp, args.pp, args.vp) == (8, 4, 5)


@pytest.mark.parametrize("name", ["torchrun.sh", "train.sbatch", "nccl_tests.sh", "nccl.env"])
def test_emitted_scripts_pass_bash_n(emitted, name):
    out, _ = emitted
    subprocess.run(["bash", "-n", str(out / name)], check=True)


def _fake_bin(tmp_path: Path, host: str, hosts: list[str]) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "torchrun": 'echo "torchrun $*"',
        "scontrol": "printf '%s\\n' " + " ".join(hosts),
        # run the command after srun's own options
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", MASTER_ADDR="a-node000")
    env["SLURMD_NODENAME"] = host  # what Slurm sets in each task: the node's name
    env.update(OUT="/runs/x", SLURM_JOB_NODELIST="ignored", SLURM_SUBMIT_DIR="")
    return env


def test_torchrun_and_slurm_scripts_start_ranks_site_by_site(emitted, tmp_path):
    out, _ = emitted
    cluster = load_cluster(THREE)
    hosts = [f"{s.name}-node{i:03d}" for s in cluster.sites for i in range(s.nodes)]
    (out / "hosts").write_text("\n".join(hosts) + "\n")
    env = _fake_bin(tmp_path, "b-node002", hosts)
    ran = subprocess.run(
        ["bash", str(out / "torchrun.sh"), "18"], env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr
    assert "--node-rank=18" in ran.stdout and "--nnodes=64" in ran.stdout
    assert "porting.cli train" in ran.stdout and "--use-tp-pp-dp-mapping" in ran.stdout
    bad = subprocess.run(["bash", str(out / "torchrun.sh"), "64"], env=env, capture_output=True)
    assert bad.returncode == 2
    ran = subprocess.run(
        ["bash", str(out / "train.sbatch")], env=env, capture_output=True, text=True, cwd=out
    )
    assert ran.returncode == 0, ran.stderr
    # b-node002 is the 19th host listed: node rank 18 whatever order Slurm used
    assert "--node-rank=18" in ran.stdout
    per_node = (out / "torchrun_per_node.txt").read_text().splitlines()
    commands = [line for line in per_node if line.startswith("torchrun")]
    assert len(commands) == 64 and "--node-rank=0 " in commands[0]
    sites = [m.group(1) for m in map(re.compile(r"^# (\S+) \(site ").match, per_node) if m]
    assert sites[:16] == [f"a-node{i:03d}" for i in range(16)]
    assert sites[16] == "b-node000" and sites[32] == "c-node000"


def test_nccl_env_sizes_the_buffer_from_the_bandwidth_delay_product(tmp_path, capsys):
    data = _small_two_sites()
    data["links"][0].update(bandwidth_gbit_s=400, distance_km=2000, count=4)
    path = _cluster_yaml(tmp_path, data)
    out = tmp_path / "launch"
    argv = ["plan", "--model", "llama-7b", "--cluster", str(path), "--global-batch", "64"]
    argv += ["--seq-length", "4096", "--layout", "tp=8,pp=1,cp=1,mb=1", "--emit", str(out)]
    assert main(argv) == 0
    env = dict(
        line.removeprefix("export ").split("=", 1)
        for line in (out / "nccl.env").read_text().splitlines()
        if line.startswith("export ")
    )
    assert int(env["NCCL_BUFFSIZE"]) > 4 << 20
    assert env["NCCL_IB_QPS_PER_CONNECTION"] == "4" and env["NCCL_IB_SPLIT_DATA_ON_QPS"] == "1"
    assert env["NCCL_IB_TIMEOUT"] == "22"


def test_plot_is_a_png(tmp_path):
    png = tmp_path / "plan.png"
    assert main([*BASE, "--cluster", str(THREE), "--plot", str(png), "--top", "4"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp*"))


def _nccl_log(path: Path, hosts: list[str], collective: str, times: dict[int, float]) -> None:
    """A log in nccl-tests' format (header, rank lines, one row per size)."""
    n = len(hosts)
    lines = [
        "# nThread 1 nGpus 1 minBytes 8 maxBytes 4294967296 step: 2(factor) warmup iters: 5",
        "#",
        "# Using devices",
    ]
    for r, h in enumerate(hosts):
        lines.append(
            f"#  Rank {r:2d} Group  0 Pid {1000 + r:6d} on {h:>10} device  {r % 8} [0x07] GPU"
        )
    lines.append(
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
    )
    for size, t in sorted(times.items()):
        algbw = size / t / 1e9
        factor = {"all_reduce": 2 * (n - 1) / n, "alltoall": (n - 1) / n}.get(collective, 1.0)
        busbw = algbw * factor
        us = t * 1e6
        row = f"{size:>12} {size // 4:>12}     float     sum      -1 {us:8.2f} {algbw:7.2f} {busbw:7.2f}      0 {us:8.2f} {algbw:7.2f} {busbw:7.2f}      0"
        lines.append(row)
    lines.append("# Out of bounds values : 0 OK")
    path.write_text("\n".join(lines) + "\n")


def test_calibration_fits_the_all_to_all_from_alltoall_logs(tmp_path, capsys):
    """nccl-tests' alltoall_perf logs (a node, two nodes of a site, across the link) set the
    all-to-all's own constants, one per level, which the MoE layers' dispatch and combine use;
    the ring constants stay."""
    path = _cluster_yaml(tmp_path, _small_two_sites())
    cluster = load_cluster(path)
    truth = Efficiency(a2a_node_bw=0.7, a2a_net_bw=0.8, a2a_wan_bw=0.5, a2a_latency=40e-6)
    logs = tmp_path / "logs"
    logs.mkdir()
    sizes = [8 << (2 * i) for i in range(15)]
    for name, level, link, site, hosts in (
        ("node_alltoall.log", NODE, None, None, ["a-node000"] * 8),
        ("site-a_alltoall.log", SITE, None, "a", ["a-node000"] * 8 + ["a-node001"] * 8),
        ("link-a-b_alltoall.log", WAN, "a-b", None, ["a-node000"] * 8 + ["b-node000"] * 8),
    ):
        t = NcclTest(name, level, link, site, "alltoall", len(hosts), len(set(hosts)), ((8, 0, 0),))
        times = {s: predict_test(cluster, truth, t, s) for s in sizes}
        _nccl_log(logs / name, hosts, "alltoall", times)
    saved = tmp_path / "constants.yaml"
    argv = ["plan", "--model", "mixtral-8x7b", "--cluster", str(path), "--global-batch", "64"]
    argv += ["--seq-length", "2048", "--calibrate", str(logs), "--save-constants", str(saved)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "a2a_node_bw=" in out and "a2a_net_bw=" in out and "a2a_wan_bw=" in out
    fitted = yaml.safe_load(saved.read_text())
    assert fitted["a2a_node_bw"] == pytest.approx(0.7, rel=0.02)
    assert fitted["a2a_net_bw"] == pytest.approx(0.8, rel=0.02)
    assert fitted["a2a_wan_bw"] == pytest.approx(0.5, rel=0.02)
    assert fitted["a2a_latency"] == pytest.approx(40e-6, rel=0.05)
    assert fitted["node_bw"] == Efficiency().node_bw and fitted["wan_rdma"] == Efficiency().wan_rdma


def test_calibration_recovers_known_efficiencies_and_fits_the_step(tmp_path, capsys):
    path = _cluster_yaml(tmp_path, _small_two_sites())
    cluster = load_cluster(path)
    truth = Efficiency(node_bw=0.6, node_latency=4e-6, wan_rdma=0.5)
    logs = tmp_path / "logs"
    logs.mkdir()
    sizes = [8 << (2 * i) for i in range(15)]
    cases = [
        ("node_all_reduce.log", NODE, None, "all_reduce", ["a-node000"] * 8),
        (
            "link-a-b_all_reduce.log",
            WAN,
            "a-b",
            "all_reduce",
            ["a-node000"] * 8 + ["b-node000"] * 8,
        ),
    ]
    for name, level, link, coll, hosts in cases:
        t = NcclTest(name, level, link, None, coll, len(hosts), len(set(hosts)), ((8, 0.0, 0.0),))
        times = {s: predict_test(cluster, truth, t, s) for s in sizes}
        _nccl_log(logs / name, hosts, coll, times)
    saved = tmp_path / "constants.yaml"
    argv = ["plan", "--model", "llama-7b", "--cluster", str(path), "--global-batch", "64"]
    argv += ["--seq-length", "2048", "--calibrate", str(logs), "--save-constants", str(saved)]
    argv += ["--measured-step", "3.0", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    fitted = yaml.safe_load(saved.read_text())
    assert fitted["node_bw"] == pytest.approx(0.6, rel=0.02)
    assert fitted["node_latency"] == pytest.approx(4e-6, rel=0.05)
    assert fitted["wan_rdma"] == pytest.approx(0.5, rel=0.02)
    assert data["step_fit"]["predicted_after_s"] == pytest.approx(3.0, rel=1e-3)
    assert {c["constant"] for c in data["calibration"]} == {"node_bw", "wan_rdma"}
    # the saved constants load back and reproduce the fitted step of the same layout
    lay = data["chosen"]["layout"]
    layout = (
        f"tp={lay['tp']},pp={lay['pp']},vp={lay['vp']},cp={lay['cp']},"
        f"mb={lay['micro_batch']},recompute={lay['recompute']},"
        f"order={'default' if lay['order'] == 'tp-cp-ep-dp-pp' else 'tp-pp-dp'},"
        f"sites={'>'.join(lay['sites'])}"
    )
    argv2 = ["plan", "--model", "llama-7b", "--cluster", str(path), "--global-batch", "64"]
    argv2 += ["--seq-length", "2048", "--constants", str(saved), "--json", "--layout", layout]
    assert main(argv2) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["chosen"]["step_s"] == pytest.approx(3.0, rel=1e-3)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["gpu"].pop("memory_gib"), "gpu.memory_gib"),
        (lambda d: d["sites"][1].update(nodes=0), "sites[1].nodes"),
        (lambda d: d["links"][0].update(sites=["a", "z"]), "links[0].sites"),
        (lambda d: d["links"][0].pop("distance_km"), "links[0].distance_km"),
        (lambda d: d["links"][0].update(transport="udp"), "links[0].transport"),
        (lambda d: d.pop("links"), "links"),
        (lambda d: d["sites"][0].pop("gpus_per_node"), "sites[0].gpus_per_node"),
        (lambda d: d["site"].update(bandwidth_gbit_s="fast"), "site.bandwidth_gbit_s"),
    ],
)
def test_bad_cluster_file_names_the_field(tmp_path, capsys, mutate, field):
    data = _small_two_sites()
    mutate(data)
    path = _cluster_yaml(tmp_path, data)
    assert main([*BASE, "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and str(path) in err
    with pytest.raises(Exception, match=field.replace("[", r"\[").replace("]", r"\]")):
        cluster_from_dict(data, str(path))


def test_link_between_unknown_sites_says_which(tmp_path, capsys):
    data = _small_two_sites()
    data["links"][0]["sites"] = ["a", "mars"]
    assert main([*BASE, "--cluster", str(_cluster_yaml(tmp_path, data))]) == 2
    assert "unknown site 'mars'" in capsys.readouterr().err


def test_model_that_fits_nowhere_is_a_clear_error(tmp_path, capsys):
    data = _small_two_sites()
    data["gpu"]["memory_gib"] = 2
    argv = ["plan", "--model", "llama-70b", "--cluster", str(_cluster_yaml(tmp_path, data))]
    assert main([*argv, "--global-batch", "64", "--seq-length", "4096"]) == 2
    err = capsys.readouterr().err
    assert "fits nowhere" in err and "memory" in err and "> 2 GiB" in err


def test_bad_model_and_layout_arguments(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10}))
    assert main(["plan", "--model", str(cfg), "--cluster", str(ONE), "--global-batch", "8",
                 "--seq-length", "128"]) == 2  # fmt: skip
    assert "num_attention_heads" in capsys.readouterr().err
    assert main([*BASE, "--cluster", str(ONE), "--layout", "tp=3"]) == 2
    assert "--layout" in capsys.readouterr().err
    assert main([*BASE, "--cluster", str(ONE), "--layout", "tp=8,pp=3"]) == 2
    assert "--layout" in capsys.readouterr().err


def test_a_sparse_sweep_takes_its_bandwidth_from_the_large_messages():
    """Two rows, 64 KiB and 1 MiB: the small one passed a token-bucket link at burst speed. The
    link's bandwidth is the large row's, not the best of the last three rows (which is both)."""
    rows = ((65536, 0.0033, 19.9e6), (1048576, 0.0883, 11.9e6))
    t = NcclTest("link-a-b_all_reduce.log", WAN, "a-b", None, "all_reduce", 2, 2, rows)
    assert t.busbw == 11.9e6
    dense = tuple((8 << i, 1.0, float(i)) for i in range(20))
    t = NcclTest("node_all_reduce.log", NODE, None, None, "all_reduce", 8, 1, dense)
    assert t.busbw == 19.0  # a doubling sweep: its last three rows, as before
