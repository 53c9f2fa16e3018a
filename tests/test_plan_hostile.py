"""`porting plan` under hostile input: every number it reads is refused by name, and its search
stays bounded at the planner's limits.

Every refusal runs the command end to end (``porting.cli.main``) and must exit 2 with one line
naming the file (or flag) and the field, no traceback, and none of the outputs it was asked to
write (``--emit``, ``--plot``, ``--save-constants``). The accepted worst cases (the most sites,
fully linked and in a ring, the most GPUs, the most nodes) must plan, and what bounds their work
is asserted as counts, never as time (scripts/bench_plan.py measures the time).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from porting.cli import main
from porting.errors import PortingError
from porting.planner import cluster_from_dict, plan
from porting.planner.limits import (
    MAX_GPUS,
    MAX_LAYOUTS,
    MAX_LOGS,
    MAX_SITE_ORDERS,
    MAX_SITES,
)
from porting.planner.model import PRESETS
from porting.planner.perf import Evaluator, Settings
from porting.planner.placement import NODE, SITE, WAN, Topology, rank_groups
from porting.planner.search import search_size

H100 = {"name": "H100", "peak_bf16_tflops": 989, "memory_gib": 80, "hbm_tbytes_s": 3.35}
NODE_LEVEL = {"bandwidth_gbytes_s": 450, "latency_us": 3}
SITE_LEVEL = {"bandwidth_gbit_s": 400, "latency_us": 5}


def _two_sites() -> dict:
    return {
        "name": "two",
        "gpu": dict(H100),
        "node": dict(NODE_LEVEL),
        "site": dict(SITE_LEVEL),
        "sites": [
            {"name": "a", "nodes": 2, "gpus_per_node": 8},
            {"name": "b", "nodes": 2, "gpus_per_node": 8},
        ],
        "links": [{"sites": ["a", "b"], "bandwidth_gbit_s": 200, "distance_km": 30}],
        "nccl": {"buffsize_mib": 4, "channels": 2},
    }


def _sites(n: int, nodes: int, gpus_per_node: int = 8, *, ring: bool) -> dict:
    """``n`` sites of ``nodes`` nodes, in a ring or every pair linked (links of varied speed)."""
    names = [f"s{i}" for i in range(n)]
    if ring:
        pairs = [(names[i], names[(i + 1) % n]) for i in range(n if n > 2 else 1)]
    else:
        pairs = list(itertools.combinations(names, 2))
    return {
        "name": f"{n}-{'ring' if ring else 'mesh'}",
        "gpu": dict(H100),
        "node": dict(NODE_LEVEL),
        "site": dict(SITE_LEVEL),
        "sites": [{"name": x, "nodes": nodes, "gpus_per_node": gpus_per_node} for x in names],
        "links": [
            {"sites": [a, b], "bandwidth_gbit_s": 100 + (37 * i) % 300, "distance_km": 10 + i % 90}
            for i, (a, b) in enumerate(pairs)
        ],
    }


def _outputs(tmp_path: Path) -> tuple[list[str], list[Path]]:
    """Flags asking for every output the command writes, and where they would be."""
    emit, png, saved = tmp_path / "launch", tmp_path / "plan.png", tmp_path / "fitted.yaml"
    flags = ["--emit", str(emit), "--plot", str(png), "--save-constants", str(saved)]
    return flags, [emit, png, saved]


def _refused(capsys, tmp_path: Path, argv: list[str], *named: str) -> str:
    """Run ``porting plan``; it must exit 2 with one line naming each of ``named``, and write
    none of its outputs."""
    flags, outputs = _outputs(tmp_path)
    assert main([*argv, *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("porting plan: error: "), lines[0]
    assert "Traceback" not in captured.err and not captured.out
    for text in named:
        assert text in lines[0], (text, lines[0])
    assert not [p for p in outputs if p.exists()]
    return lines[0]


def _plan_argv(cluster: Path, model: str = "llama-7b") -> list[str]:
    return ["plan", "--model", model, "--cluster", str(cluster)] + [
        "--global-batch", "64", "--seq-length", "2048"
    ]  # fmt: skip


def _write_yaml(tmp_path: Path, data: object, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


# --- every number of a cluster file, every kind of bad value

# (section, field): where it sits in _two_sites() and its path in the error
CLUSTER_NUMBERS = [
    ("gpu", "peak_bf16_tflops"),
    ("gpu", "memory_gib"),
    ("gpu", "hbm_tbytes_s"),
    ("node", "bandwidth_gbytes_s"),
    ("node", "latency_us"),
    ("site", "bandwidth_gbit_s"),
    ("site", "latency_us"),
    ("sites[1]", "nodes"),
    ("sites[1]", "gpus_per_node"),
    ("links[0]", "bandwidth_gbit_s"),
    ("links[0]", "count"),
    ("links[0]", "distance_km"),
    ("links[0]", "rtt_ms"),
    ("nccl", "buffsize_mib"),
    ("nccl", "channels"),
    ("nccl", "qps_per_connection"),
    ("nccl", "socket_threads"),
    ("nccl", "socks_per_thread"),
]
# where zero is a real value (no latency, no distance), it is not among the bad ones
MAY_BE_ZERO = {"latency_us", "distance_km"}
BAD_NUMBERS = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "negative": -1,
    "zero": 0,
    "true": True,
    "string": "400",
    "list": [1],
    "huge": 10**12,
    "past-float": 10**400,
}


def _section(data: dict, section: str) -> dict:
    if "[" in section:
        key, index = section.rstrip("]").split("[")
        return data[key][int(index)]
    return data[section]


# Zero is a real latency and distance: not a bad value for those fields.
_CLUSTER_CASES = [
    (section, field, bad)
    for section, field in CLUSTER_NUMBERS
    for bad in BAD_NUMBERS
    if not (bad == "zero" and field in MAY_BE_ZERO)
]


@pytest.mark.parametrize("section, field, bad", _CLUSTER_CASES)
def test_every_cluster_number_is_checked_by_name(tmp_path, capsys, section, field, bad):
    data = _two_sites()
    _section(data, section)[field] = BAD_NUMBERS[bad]
    if field == "rtt_ms":
        del data["links"][0]["distance_km"]
    path = _write_yaml(tmp_path, data)
    _refused(capsys, tmp_path, _plan_argv(path), str(path), f"{section}.{field}")


@pytest.mark.parametrize("field", ["peak_bf16_tflops", "memory_gib", "hbm_tbytes_s"])
def test_a_per_site_override_is_checked_under_its_site(tmp_path, capsys, field):
    data = _two_sites()
    data["sites"][1]["gpu"] = {field: math.inf}
    path = _write_yaml(tmp_path, data)
    _refused(capsys, tmp_path, _plan_argv(path), str(path), f"sites[1].gpu.{field}")


def test_the_issue_rows_are_refused(tmp_path, capsys):
    """The probe's rows: 10**12 nodes, two sites of a million nodes, .nan bandwidth and .inf
    TFLOPS (which planned "0.00 s per step")."""
    data = _two_sites()
    data["sites"][1]["nodes"] = 10**12
    path = _write_yaml(tmp_path, data)
    line = _refused(capsys, tmp_path, _plan_argv(path), str(path), "sites[1].nodes")
    assert "1000000000000 is more than the planner's limit of" in line
    data = _two_sites()
    for site in data["sites"]:
        site["nodes"] = 10**6
    path = _write_yaml(tmp_path, data)
    _refused(capsys, tmp_path, _plan_argv(path), str(path), "sites[0].nodes", "limit")
    data = _two_sites()
    data["site"]["bandwidth_gbit_s"] = math.nan
    path = _write_yaml(tmp_path, data)
    _refused(capsys, tmp_path, _plan_argv(path), "site.bandwidth_gbit_s: nan is not a finite")
    data = _two_sites()
    data["gpu"]["peak_bf16_tflops"] = math.inf
    path = _write_yaml(tmp_path, data)
    _refused(capsys, tmp_path, _plan_argv(path), "gpu.peak_bf16_tflops: inf is not a finite")


def test_sites_adding_up_past_the_gpu_limit_are_refused_at_the_site_that_does(tmp_path, capsys):
    per_site = MAX_GPUS // 8 // 2 + 1  # two such sites of 8-GPU nodes are just over
    data = _two_sites()
    for site in data["sites"]:
        site["nodes"] = per_site
    path = _write_yaml(tmp_path, data)
    line = _refused(capsys, tmp_path, _plan_argv(path), str(path), "sites[1].nodes")
    assert f"limit of {MAX_GPUS} GPUs in all sites" in line


# A full mesh of 1000 sites is half a million links: the file cap refuses that file first.
@pytest.mark.parametrize(
    "count,ring", [(MAX_SITES + 1, True), (MAX_SITES + 1, False), (1000, True)]
)
def test_more_sites_than_the_limit_are_refused_by_name(tmp_path, capsys, count, ring):
    path = _write_yaml(tmp_path, _sites(count, 1, ring=ring))
    line = _refused(capsys, tmp_path, _plan_argv(path), str(path), "sites:")
    assert f"{count} sites is more than the planner's limit of {MAX_SITES}" in line


@pytest.mark.parametrize(
    "name",
    ["a\nrm -rf ~", "$(reboot)", "a b", "1a", "a.b", "x" * 65, 7, ["a"]],
)
def test_site_names_that_would_land_in_scripts_are_refused(tmp_path, capsys, name):
    data = _two_sites()
    data["sites"][0]["name"] = name
    data["links"][0]["sites"][0] = name if isinstance(name, str) else "a"
    path = _write_yaml(tmp_path, data)
    _refused(capsys, tmp_path, _plan_argv(path), str(path), "sites[0].name")


@pytest.mark.parametrize("name", ['x"""; import os', "a\nb", "back\\slash", 5.5])
def test_cluster_and_gpu_names_that_would_land_in_code_are_refused(tmp_path, capsys, name):
    for where in ("name", "gpu.name"):
        data = _two_sites()
        if where == "name":
            data["name"] = name
        else:
            data["gpu"]["name"] = name
        path = _write_yaml(tmp_path, data)
        _refused(capsys, tmp_path, _plan_argv(path), str(path), f"{where}:")


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["links"][0].update(sites=[["a"], "b"]), "links[0].sites"),
        (lambda d: d["links"][0].update(sites="ab"), "links[0].sites"),
        (lambda d: d["links"][0].update(transport=["rdma"]), "links[0].transport"),
        (lambda d: d.update(sites={"a": 1}), "sites"),
        (lambda d: d.update(links={"a": 1}), "links"),
        (lambda d: d.update(nccl=[1]), "nccl"),
        (lambda d: d["sites"].__setitem__(0, "a"), "sites[0]"),
    ],
)
def test_wrong_shapes_are_refused_by_name(tmp_path, capsys, mutate, field):
    data = _two_sites()
    mutate(data)
    path = _write_yaml(tmp_path, data)
    _refused(capsys, tmp_path, _plan_argv(path), str(path), field)


def test_more_links_than_pairs_are_refused(tmp_path, capsys):
    data = _two_sites()
    data["links"] = data["links"] * 5000
    path = _write_yaml(tmp_path, data)
    _refused(capsys, tmp_path, _plan_argv(path), str(path), "links:", "pairs")


# --- the files themselves


def _unnamed() -> dict:
    data = _two_sites()
    del data["name"]
    return data


def _alias_bomb(levels: int = 30) -> str:
    lines = ["a0: &a0 [x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, problem",
    [
        (_alias_bomb() + "name: *a29\n" + yaml.safe_dump(_unnamed()), "expands to more than"),
        (_alias_bomb() + "sites: *a29\n", "expands to more than"),
        ("[" * 100_000 + "]" * 100_000, "nesting depth"),
        (
            f"sites: [{{name: a, nodes: {'9' * 5000}, gpus_per_node: 8}}]",
            "a number of 5000 characters",
        ),
        ("sites: [a, b\n", "not YAML data"),
        ("", "top level"),
        ("- 1\n- 2\n", "top level"),
    ],
)
def test_hostile_yaml_is_one_error(tmp_path, capsys, text, problem):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    _refused(capsys, tmp_path, _plan_argv(path), str(path), problem)


def test_unreadable_cluster_files_are_one_error(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20))
    _refused(capsys, tmp_path, _plan_argv(big), str(big), "limit")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: \xff\xfe\n")
    _refused(capsys, tmp_path, _plan_argv(binary), str(binary), "not UTF-8")
    _refused(capsys, tmp_path, _plan_argv(Path("/dev/zero")), "/dev/zero", "not a regular file")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    _refused(capsys, tmp_path, _plan_argv(folder), str(folder), "not a regular file")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    _refused(capsys, tmp_path, _plan_argv(fifo), str(fifo), "not a regular file")


# --- model configs

MODEL_FIELDS = [
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
]


def _config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 688,
        "vocab_size": 1024,
        "head_dim": 32,
    }


@pytest.mark.parametrize("bad", [b for b in BAD_NUMBERS if b != "zero"] + ["float"])
@pytest.mark.parametrize("field", MODEL_FIELDS)
def test_every_model_number_is_checked_by_name(tmp_path, capsys, field, bad):
    cfg = _config()
    cfg[field] = 64.0 if bad == "float" else BAD_NUMBERS[bad]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))  # NaN and Infinity as Python's json writes them
    argv = _plan_argv(Path("examples/clusters/two-sites.yaml"), model=str(path))
    _refused(capsys, tmp_path, argv, str(path), field)


@pytest.mark.parametrize("field", [f for f in MODEL_FIELDS if f != "head_dim"])
def test_a_zero_model_size_is_refused(tmp_path, capsys, field):
    cfg = _config()
    cfg[field] = 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    argv = _plan_argv(Path("examples/clusters/two-sites.yaml"), model=str(path))
    _refused(capsys, tmp_path, argv, str(path), field)


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"hidden_size": 1e999}', "1e999 is not finite"),
        ('{"hidden_size": ' + "9" * 5000 + "}", "a number of 5000 characters"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper than 100 levels"),
        ("[1, 2]", "expected a JSON object"),
        ('{"hidden_size": 64,', "not valid JSON"),
        (
            '{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
            '"vocab_size": 100, "intermediate_size": 96, "num_local_experts": ['
            + "[1]," * 1000
            + "1]}",
            "num_local_experts: expected an integer",
        ),
    ],
)
def test_hostile_model_configs_are_one_error(tmp_path, capsys, text, problem):
    path = tmp_path / "config.json"
    path.write_text(text)
    argv = _plan_argv(Path("examples/clusters/two-sites.yaml"), model=str(path))
    line = _refused(capsys, tmp_path, argv, str(path), problem)
    assert len(line) < 1000


def test_a_checkpoint_manifest_that_is_not_a_mapping_is_refused(tmp_path, capsys):
    manifest = tmp_path / "ckpt" / "context" / "porting.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("5")
    argv = _plan_argv(Path("examples/clusters/two-sites.yaml"), model=str(tmp_path / "ckpt"))
    _refused(capsys, tmp_path, argv, str(manifest), "hf_config")


# --- constants files and nccl-tests logs

CONSTANTS = [
    "compute",
    "memory_passes",
    "node_bw",
    "site_bw",
    "wan_rdma",
    "wan_tcp",
    "node_latency",
    "site_latency",
    "wan_latency_scale",
]


@pytest.mark.parametrize("bad", ["nan", "inf", "negative", "true", "string", "huge", "past-float"])
@pytest.mark.parametrize("name", CONSTANTS)
def test_every_constant_is_checked_by_name(tmp_path, capsys, name, bad):
    path = _write_yaml(tmp_path, {name: BAD_NUMBERS[bad]}, "constants.yaml")
    argv = [*_plan_argv(Path("examples/clusters/two-sites.yaml")), "--constants", str(path)]
    _refused(capsys, tmp_path, argv, str(path), name)


def _log(path: Path, rows: list[str], ranks: str = "0") -> None:
    header = [
        "# nThread 1 nGpus 1 minBytes 8 maxBytes 1024 step: 2(factor)",
        f"#  Rank {ranks} Group  0 Pid   1000 on  a-node000 device  0 [0x07] GPU",
        "#  Rank  1 Group  0 Pid   1001 on  a-node000 device  1 [0x07] GPU",
    ]
    path.write_text("\n".join(header + rows) + "\n")


def _row(size: str, time_us: str, busbw: str) -> str:
    return f"{size} {size} float sum -1 {time_us} 1.00 {busbw} 0 {time_us} 1.00 {busbw} 0"


@pytest.mark.parametrize(
    "rows, problem",
    [
        ([_row("8", "nan", "1.0"), _row("1024", "5.0", "2.0")], "line 4: time (us): nan"),
        ([_row("8", "5.0", "inf"), _row("1024", "5.0", "2.0")], "line 4: busbw (GB/s): inf"),
        ([_row("8", "-5.0", "1.0"), _row("1024", "5.0", "2.0")], "time (us): must be at least 0"),
        ([_row("8", "5.0", "1e300"), _row("1024", "5.0", "2.0")], "busbw (GB/s): 1e+300 is more"),
        ([_row("9" * 30, "5.0", "1.0")], "line 4: size"),
        ([_row("8", "5.0", "0"), _row("1024", "5.0", "0")], "no bandwidth"),
        ([_row("8", "0.001", "900000"), _row("1024", "0.001", "900000")], "fitted: node_bw"),
    ],
)
def test_hostile_nccl_tests_logs_are_one_error(tmp_path, capsys, rows, problem):
    logs = tmp_path / "logs"
    logs.mkdir()
    _log(logs / "node_all_reduce.log", rows)
    argv = [*_plan_argv(Path("examples/clusters/two-sites.yaml")), "--calibrate", str(logs)]
    _refused(capsys, tmp_path, argv, str(logs / "node_all_reduce.log"), problem)


def test_a_log_with_a_5000_digit_rank_is_one_error(tmp_path, capsys):
    """A 5000-digit rank is no rank line; the one rank left measures no collective."""
    logs = tmp_path / "logs"
    logs.mkdir()
    _log(logs / "node_all_reduce.log", [_row("1024", "5.0", "2.0")], ranks="9" * 5000)
    argv = [*_plan_argv(Path("examples/clusters/two-sites.yaml")), "--calibrate", str(logs)]
    _refused(capsys, tmp_path, argv, "node_all_reduce.log", "1 rank")


def test_calibration_reads_a_bounded_number_of_bounded_logs(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in range(MAX_LOGS + 1):
        (logs / f"node_{i}_all_reduce.log").write_text("")
    argv = [*_plan_argv(Path("examples/clusters/two-sites.yaml")), "--calibrate", str(logs)]
    _refused(capsys, tmp_path, argv, str(logs), f"limit of {MAX_LOGS} logs")
    for f in logs.iterdir():
        f.unlink()
    for i in range(65):
        (logs / f"node_{i}_all_reduce.log").write_text("#" * (1 << 20))
    _refused(capsys, tmp_path, argv, str(logs), "bytes of logs is more than")
    for f in logs.iterdir():
        f.unlink()
    (logs / "node_all_reduce.log").write_text("#" * ((1 << 20) + 1))
    _refused(capsys, tmp_path, argv, "node_all_reduce.log", "limit")
    (logs / "node_all_reduce.log").unlink()
    os.mkfifo(logs / "node_all_reduce.log")
    _refused(capsys, tmp_path, argv, "node_all_reduce.log", "not a regular file")


# --- flags


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--seq-length", "0"),
        ("--seq-length", "-4096"),
        ("--seq-length", "1e3"),
        ("--seq-length", "nan"),
        ("--seq-length", str(10**12)),
        ("--seq-length", "9" * 5000),
        ("--seq-length", "²"),
        ("--global-batch", "0"),
        ("--global-batch", str(10**30)),
        ("--global-batch", "inf"),
        ("--top", "0"),
        ("--top", "-1"),
        ("--instances", "0"),
        ("--instances", str(10**12)),
        ("--micro-batches", "1,nan"),
        ("--micro-batches", "1,0"),
        ("--micro-batches", ",".join(str(i) for i in range(1, 18))),
        ("--micro-batches", str(10**9)),
        ("--measured-step", "nan"),
        ("--measured-step", "inf"),
        ("--measured-step", "-1"),
        ("--measured-step", "1e300"),
        ("--measured-step", "fast"),
        ("--layout", "tp=1e3"),
        ("--layout", f"tp={10**30}"),
        ("--layout", "tp=0"),
        ("--layout", "pp=²"),
        ("--layout", "tp=3"),
        ("--layout", "pp=2,order=default,sites=a\nb"),
    ],
)
def test_every_numeric_flag_is_checked_by_name(tmp_path, capsys, flag, value):
    argv = [*_plan_argv(Path("examples/clusters/two-sites.yaml")), flag, value]
    _refused(capsys, tmp_path, argv, flag)


def test_plan_checks_its_own_arguments():
    cluster = cluster_from_dict(_two_sites())
    for seq, gb in [(0, 64), (2048, 0), (10**12, 64), (2048, 10**12)]:
        with pytest.raises(PortingError, match="--seq-length|--global-batch"):
            plan(PRESETS["tiny"], cluster, seq, gb)


# --- the search at the planner's limits


def _bounded(result, cluster) -> None:
    """What bounds a search: candidates, orders of the sites, placements worked out."""
    assert result.considered <= MAX_LAYOUTS
    assert 1 <= len(result.site_orders) <= MAX_SITE_ORDERS
    assert len(cluster.site_orders()) <= MAX_SITE_ORDERS
    assert result.placements_computed <= result.considered
    assert result.ranked and all(math.isfinite(p.step) and p.step > 0 for p in result.ranked)


def test_twelve_fully_linked_sites_plan_with_twelve_orders():
    """12 fully linked sites have 12!/2 linked orders, and the probe never saw the end of them;
    12 in a ring have 12, all of which are tried."""
    mesh = cluster_from_dict(_sites(12, 2, ring=False))
    assert not mesh.every_site_order
    result = plan(PRESETS["llama-13b"], mesh, 4096, 96)
    _bounded(result, mesh)
    assert len(result.site_orders) == MAX_SITE_ORDERS
    assert any("the links allow more than" in n for n in result.notes)
    ring = cluster_from_dict(_sites(12, 2, ring=True))
    assert ring.every_site_order and len(ring.site_orders()) == 12
    _bounded(plan(PRESETS["llama-13b"], ring, 4096, 96), ring)


@pytest.mark.parametrize("ring", [False, True])
def test_the_most_sites_with_the_most_gpus_plan_within_the_bounds(ring):
    """64 sites (the limit), fully linked (2016 links) or in a ring, of 4096 GPUs each: the
    planner's GPU limit. Pipelines that would need a link the ring does not have are rejected
    with that reason, not fatal."""
    nodes = MAX_GPUS // MAX_SITES // 8
    cluster = cluster_from_dict(_sites(MAX_SITES, nodes, ring=ring))
    assert cluster.world == MAX_GPUS
    result = plan(PRESETS["llama-70b"], cluster, 4096, 4096)
    _bounded(result, cluster)
    if ring:
        assert any("no link between" in r.reason for r in result.rejected)


def test_the_most_nodes_plan_within_the_bounds():
    """One GPU a node, as many nodes as the GPU limit allows, in two sites."""
    data = _sites(2, MAX_GPUS // 2, gpus_per_node=1, ring=True)
    cluster = cluster_from_dict(data)
    assert cluster.nodes == MAX_GPUS
    result = plan(PRESETS["llama-7b"], cluster, 4096, 4096)
    _bounded(result, cluster)


def test_a_sparse_link_graph_is_walked_a_bounded_number_of_steps():
    """A ring of 64 with chords: partial orders die late, the walk stops at its step limit."""
    data = _sites(MAX_SITES, 1, ring=True)
    names = [s["name"] for s in data["sites"]]
    for i in range(0, MAX_SITES, 3):
        data["links"].append(
            {"sites": [names[i], names[(i + 7) % MAX_SITES]], "bandwidth_gbit_s": 50, "rtt_ms": 1}
        )
    cluster = cluster_from_dict(data)
    orders = cluster.site_orders()
    assert 1 <= len(orders) <= MAX_SITE_ORDERS and not cluster.every_site_order
    for order in orders:
        assert sorted(order) == sorted(names)
        cluster.reordered(order).ring_links()  # every neighbour linked, and the wrap


@pytest.mark.parametrize("n", [3, 4, 5])
def test_few_orders_are_all_of_them_as_before(n):
    """Where the links allow at most MAX_SITE_ORDERS orders, the listing is the exhaustive one
    (every linked permutation, one of each reversed pair, in permutation order)."""
    for extra in range(0, 4):
        data = _sites(n, 1, ring=True)
        names = [s["name"] for s in data["sites"]]
        chords = [
            p
            for p in itertools.combinations(names, 2)
            if abs(names.index(p[0]) - names.index(p[1])) not in (1, n - 1)
        ]
        for a, b in chords[:extra]:
            data["links"].append({"sites": [a, b], "bandwidth_gbit_s": 10, "rtt_ms": 2})
        cluster = cluster_from_dict(data)
        expected = []
        for perm in itertools.permutations(names):
            if names.index(perm[0]) > names.index(perm[-1]):
                continue
            try:
                cluster.reordered(perm).ring_links()
            except PortingError:
                continue
            expected.append(perm)
        if len(expected) <= MAX_SITE_ORDERS:
            assert cluster.site_orders() == expected and cluster.every_site_order
        else:
            orders = cluster.site_orders()
            assert orders[0] == tuple(names) and len(orders) <= MAX_SITE_ORDERS
            assert set(orders) <= set(expected) and not cluster.every_site_order


def test_a_layout_in_an_order_of_the_sites_the_search_left_out_is_still_checked(tmp_path, capsys):
    """--layout takes any order the links allow, not only the 12 the search tried."""
    data = _sites(12, 1, ring=False)
    path = _write_yaml(tmp_path, data)
    cluster = cluster_from_dict(data)
    tried = set(cluster.site_orders())
    names = [s["name"] for s in data["sites"]]
    order = next(p for p in itertools.permutations(names) if p[0] == names[0] and p not in tried)
    argv = ["plan", "--model", "tiny", "--cluster", str(path), "--global-batch", "48"]
    argv += [
        "--seq-length",
        "2048",
        "--json",
        "--layout",
        f"pp=4,order=default,sites={'>'.join(order)}",
    ]
    assert main(argv) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]["layout"]
    assert tuple(chosen["sites"]) == order and chosen["pp"] == 4


def test_the_count_of_the_search_is_exact():
    """search_size counts what the search considers without placing anything: the budget it
    enforces is the search's real size."""
    for data, model, gb in [
        (_two_sites(), "llama-7b", 64),
        (_sites(3, 2, ring=True), "llama-13b", 96),
        (_sites(4, 1, ring=False), "tiny", 48),
    ]:
        cluster = cluster_from_dict(data)
        result = plan(PRESETS[model], cluster, 2048, gb)
        fixed, per_order = search_size(Evaluator(PRESETS[model], cluster, 2048, gb))
        assert result.considered == fixed + per_order * len(result.site_orders)


def test_the_budget_cuts_orders_of_the_sites_before_anything_else():
    """Four fully linked sites (12 orders) with every micro-batch from 1 to 16: the orders tried
    are cut to what fits the budget, the file's first, and the plan says so."""
    cluster = cluster_from_dict(_sites(4, 15, ring=False))
    settings = Settings(micro_batches=tuple(range(1, 17)))
    result = plan(PRESETS["llama-7b"], cluster, 2048, 2**11 * 3 * 5 * 7, settings)
    assert result.considered <= MAX_LAYOUTS
    assert result.site_orders[0] == tuple(s.name for s in cluster.sites)
    assert 1 <= len(result.site_orders) < len(cluster.site_orders())
    assert any(f"within {MAX_LAYOUTS} layouts" in n for n in result.notes)


def test_a_search_past_the_budget_with_one_order_is_refused(tmp_path, capsys):
    """The widest search one site can ask for: 1024 GPUs a node, heads with many divisors,
    every micro-batch from 1 to 16: refused with what to narrow, before any layout is tried."""
    data = _two_sites()
    data["sites"] = [{"name": "a", "nodes": 240, "gpus_per_node": 720}]
    data["links"] = []
    cfg = _config()
    cfg.update(hidden_size=720 * 8, num_attention_heads=720, num_key_value_heads=720)
    cfg.update(num_hidden_layers=2520, head_dim=8)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(cfg))
    cluster = _write_yaml(tmp_path, data)
    argv = ["plan", "--model", str(model), "--cluster", str(cluster), "--seq-length", "2048"]
    argv += ["--global-batch", str(2**10 * 3**2 * 5 * 7), "--micro-batches"]
    argv += [",".join(str(i) for i in range(1, 17))]
    _refused(capsys, tmp_path, argv, f"more than the planner's limit of {MAX_LAYOUTS} layouts")


# --- the bounded placement is the rank-by-rank one


def _reference(topo: Topology, tp, cp, pp, dp, instances, order):
    """Group shapes as the planner worked them out before, rank by rank (kept here as the
    reference the array version must equal)."""
    cluster = topo.cluster
    world = topo.world
    site_of = [int(x) for x in topo.site_of]
    node_of = [int(x) for x in topo.node_of]
    sizes = {"tp": tp, "cp": cp, "ep": 1, "pp": pp, "dp": dp}

    def shape(groups):
        level, per_node, links = NODE, 1 << 30, {}
        for g in groups:
            counts = {}
            for r in g:
                counts[node_of[r]] = counts.get(node_of[r], 0) + 1
            per_node = min(per_node, min(counts.values()))
            if len(counts) > 1:
                level = max(level, SITE)
            n = len(g)
            for i in range(n if n > 2 else n - 1):
                sa, sb = site_of[g[i]], site_of[g[(i + 1) % n]]
                if sa != sb:
                    level = WAN
                    key = tuple(sorted((cluster.sites[sa].name, cluster.sites[sb].name)))
                    links.setdefault(key, cluster.link(*key))
        return (len(groups[0]), level, per_node, tuple(links.values()), len(groups))

    def boundary(groups, i, j):
        worst, link = NODE, None
        for g in groups:
            a, b = g[i], g[j]
            lv = NODE if node_of[a] == node_of[b] else SITE if site_of[a] == site_of[b] else WAN
            worst = max(worst, lv)
            if lv == WAN and link is None:
                link = cluster.link(cluster.sites[site_of[a]].name, cluster.sites[site_of[b]].name)
        return worst, link

    dp_groups = rank_groups(world, sizes, order, "dp-cp")
    chunk = (dp * cp) // instances
    pp_groups = rank_groups(world, sizes, order, "pp")
    return {
        "tp": shape(rank_groups(world, sizes, order, "tp")),
        "cp": shape(rank_groups(world, sizes, order, "cp")),
        "dp": shape(dp_groups),
        "instance": shape(
            [g[i * chunk : (i + 1) * chunk] for g in dp_groups for i in range(instances)]
        ),
        "cross": shape([g[j::chunk] for g in dp_groups for j in range(chunk)]),
        "pp_boundaries": tuple(boundary(pp_groups, i, i + 1) for i in range(pp - 1)),
        "pp_wrap": boundary(pp_groups, pp - 1, 0) if pp > 1 else (NODE, None),
    }


@st.composite
def _layouts(draw):
    n_sites = draw(st.integers(1, 4))
    gpn = draw(st.sampled_from([1, 2, 4, 6, 8]))
    sites = [
        {
            "name": f"s{i}",
            "nodes": draw(st.integers(1, 5)),
            "gpus_per_node": draw(st.sampled_from([gpn, 2 * gpn])),
        }
        for i in range(n_sites)
    ]
    data = _two_sites()
    data["sites"] = sites
    data["links"] = [
        {"sites": [a["name"], b["name"]], "bandwidth_gbit_s": 100, "distance_km": 10}
        for a, b in itertools.combinations(sites, 2)
    ]
    cluster = cluster_from_dict(data)
    world = cluster.world
    # TP that does not divide a node is no layout the search makes, but the placement is exact
    tp = draw(st.sampled_from([d for d in (1, 2, 3, 4, 8) if world % d == 0]))
    rest = world // tp
    cp = draw(st.sampled_from([d for d in (1, 2, 3, 4) if rest % d == 0]))
    pp = draw(st.sampled_from([d for d in range(1, rest // cp + 1) if (rest // cp) % d == 0]))
    dp = rest // cp // pp
    instances = draw(st.sampled_from([k for k in range(1, dp * cp + 1) if (dp * cp) % k == 0]))
    order = draw(st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]))
    return cluster, tp, cp, pp, dp, instances, order


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layouts())
def test_the_array_placement_equals_the_rank_by_rank_one(case):
    cluster, tp, cp, pp, dp, instances, order = case
    topo = Topology(cluster)
    got = topo.placement(tp, cp, pp, dp, instances, order)
    want = _reference(topo, tp, cp, pp, dp, instances, order)
    for part in ("tp", "cp", "dp", "instance", "cross"):
        g = getattr(got, part)
        assert (g.size, g.level, g.members_per_node, g.links, g.count) == want[part], part
    assert got.pp_boundaries == want["pp_boundaries"] and got.pp_wrap == want["pp_wrap"]
    # the fewest instances that keep each inside a site, as the old search found them
    d = dp * cp
    fewest = next(
        k
        for k in range(1, d + 1)
        if d % k == 0 and _reference(topo, tp, cp, pp, dp, k, order)["instance"][1] < WAN
    )
    assert topo.fewest_instances(tp, cp, pp, dp, order) == fewest
