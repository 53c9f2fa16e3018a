#!/usr/bin/env python
"""Measure the planner's communication model on shaped links: a two-"site" test bed on this machine.

Each site is a network namespace of its own; the two are joined by a veth pair whose ends are both
shaped by the kernel's token-bucket filter (``tc qdisc ... tbf rate R``), so traffic between the
sites runs at a known bandwidth while traffic inside a site (loopback) does not. Latency is not
emulated: the netem qdisc is not available on these machines, so the link's round trip is the
veth pair's own (tens of microseconds), measured and written into the cluster file.

Then, over real gloo process groups whose ranks run inside the namespaces:

1. collectives (all-reduce, reduce-scatter, all-gather, point-to-point, and the all-to-all of an
   MoE layer's dispatch and combine) across the link, one rank per site and two, at several
   sizes, written as nccl-tests-format logs (``logs/``) that ``porting plan --calibrate`` reads;
   each is compared with the planner's prediction for a cluster file that describes the same link
   (``cluster.yaml``), with the default constants and after fitting the link's efficiency to one
   log (the two-rank all-reduce) and the all-to-all's constants to the two-rank all-to-all, and
   predicting the rest;
2. with ``--train``: a real ``porting train`` of a tiny model under torchrun (gloo, CPU, the
   plain optimizer: see :func:`predict_train`): one site
   (two processes in one namespace) against two sites (a torchrun node in each namespace), with
   data parallelism across the link (tp-cp-ep-pp-dp order) and with the pipeline across it (the
   default order), each predicted by the planner after fitting compute to the one-site run of the
   same layout (``--measured-step``).

Needs the privilege to create network namespaces (root, or CAP_NET_ADMIN and CAP_SYS_ADMIN) and
``ip`` and ``tc`` (iproute2); without them it says so and exits 3. Only addresses inside the
namespaces it creates are used; every transfer is bounded in size and every run in time; the
namespaces are deleted on exit, on an error and on Ctrl-C.

    python scripts/bench_sites.py --rate-mbit 100 --train --out /tmp/sites
    python scripts/bench_sites.py --quick --json          # the suite's small version
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITES = ("a", "b")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "sendrecv", "alltoall")
RUN_TIMEOUT = 240  # seconds for one group of worker processes or one training run
MAX_BYTES = 64 << 20  # no transfer above this (the bed moves bounded traffic)


class NoPrivilege(RuntimeError):
    """The test bed cannot be built here (no namespaces, no iproute2)."""


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


class TestBed:
    """Two network namespaces joined by a shaped veth pair; deleted by :meth:`close`."""

    def __init__(self, rate_mbit: float, burst_kib: int = 32):
        tag = f"{os.getpid() % 100000}"
        self.rate_mbit = rate_mbit
        self.burst_kib = burst_kib
        self.ns = {s: f"porting-sites-{tag}-{s}" for s in SITES}
        self.dev = {s: f"pts{tag}{s}" for s in SITES}
        octet = os.getpid() % 250 + 1
        self.addr = {"a": f"10.213.{octet}.1", "b": f"10.213.{octet}.2"}
        self.made: list[str] = []

    def open(self) -> TestBed:
        """Create both namespaces, the veth pair, the addresses and the shaping."""
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NoPrivilege(f"`{tool}` (iproute2) is not installed")
        for s in SITES:
            r = _run(["ip", "netns", "add", self.ns[s]], check=False)
            if r.returncode:
                raise NoPrivilege(
                    f"cannot create network namespace {self.ns[s]} ({r.stderr.strip()}): the "
                    "test bed needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN"
                )
            self.made.append(self.ns[s])
        a, b = SITES
        _run(["ip", "link", "add", self.dev[a], "type", "veth", "peer", "name", self.dev[b]])
        for s in SITES:
            _run(["ip", "link", "set", self.dev[s], "netns", self.ns[s]])
            _run(["ip", "-n", self.ns[s], "addr", "add", f"{self.addr[s]}/30", "dev", self.dev[s]])
            _run(["ip", "-n", self.ns[s], "link", "set", self.dev[s], "up"])
            _run(["ip", "-n", self.ns[s], "link", "set", "lo", "up"])
            # both directions shaped: each end's egress; the limit bounds the queue's delay
            _run(
                ["ip", "netns", "exec", self.ns[s], "tc", "qdisc", "add", "dev", self.dev[s],
                 "root", "tbf", "rate", f"{self.rate_mbit}mbit", "burst", f"{self.burst_kib}kb",
                 "latency", "200ms"]
            )  # fmt: skip
        return self

    def close(self) -> None:
        """Delete the namespaces (their veth ends and qdiscs go with them)."""
        while self.made:
            _run(["ip", "netns", "del", self.made.pop()], check=False)

    def exec_argv(self, site: str, env: dict[str, str], argv: list[str]) -> list[str]:
        """``argv`` run inside ``site``'s namespace with ``env`` (gloo bound to the site's veth)."""
        pairs = [f"{k}={v}" for k, v in {**env, "GLOO_SOCKET_IFNAME": self.dev[site]}.items()]
        return ["ip", "netns", "exec", self.ns[site], "env", *pairs, *argv]


def free_port() -> int:
    """A port number free on this machine (the namespaces have ports of their own, all free)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argvs: list[list[str]], timeout: float) -> list[str]:
    """Start every command in its own session, wait for all; kill every one on a timeout or an
    error. Returns their outputs; raises with the failing one's tail."""
    procs = [
        subprocess.Popen(
            a, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for a in argvs
    ]
    outs: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            left = max(1.0, deadline - time.monotonic())
            outs.append(p.communicate(timeout=left)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
    if bad:
        i, rc = bad[0]
        raise RuntimeError(f"process {i} exited {rc}: {' '.join(argvs[i][-6:])}\n{outs[i][-3000:]}")
    return outs


# --- measurements -------------------------------------------------------------------------------


def measure_rtt(bed: TestBed) -> float:
    """Median round trip of a 1-byte TCP echo from site a to site b (seconds)."""
    port = free_port()
    server = (
        "import socket,sys\n"
        f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        f"s.bind(('{bed.addr['b']}',{port}));s.listen(1);c,_=s.accept()\n"
        "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
        "while (d:=c.recv(1)): c.sendall(d)\n"
    )
    client = (
        "import socket,time,statistics\n"
        "for _ in range(100):\n"
        "    try:\n"
        f"        c=socket.create_connection(('{bed.addr['b']}',{port}),timeout=5);break\n"
        "    except OSError: time.sleep(0.05)\n"
        "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1);ts=[]\n"
        "for _ in range(200):\n"
        "    t=time.perf_counter();c.sendall(b'x');c.recv(1);ts.append(time.perf_counter()-t)\n"
        "print(statistics.median(ts))\n"
    )
    outs = _spawn(
        [
            bed.exec_argv("b", {}, [sys.executable, "-c", server]),
            bed.exec_argv("a", {}, [sys.executable, "-c", client]),
        ],
        60,
    )
    return float(outs[1].split()[-1])


def worker(args: argparse.Namespace) -> int:
    """One rank of the collective measurements (run inside a namespace by :func:`collectives`)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=__import__("datetime").timedelta(seconds=RUN_TIMEOUT),
    )
    rank, world = args.rank, args.world
    results = []
    for op in args.ops.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            n = max(world, size // 4 // world * world)  # fp32 elements, divisible by the world
            buf = torch.ones(n)
            chunks = list(buf.chunk(world))

            def once(op=op, buf=buf, chunks=chunks) -> None:
                if op == "all_reduce":
                    dist.all_reduce(buf)
                elif op == "reduce_scatter":
                    dist.reduce_scatter(torch.empty_like(chunks[0]), chunks)
                elif op == "all_gather":
                    dist.all_gather([torch.empty_like(chunks[0]) for _ in chunks], chunks[rank])
                elif op == "alltoall":  # an MoE layer's dispatch: 1/world of the buffer to each
                    dist.all_to_all_single(torch.empty_like(buf), buf)
                elif rank == 0:  # sendrecv: rank 0 (site a) to the last rank (site b)
                    dist.send(buf, world - 1)
                elif rank == world - 1:
                    dist.recv(buf, 0)

            once()  # warm-up: connections and buffers
            times = []
            spent, t_all = 0.0, time.perf_counter()
            while len(times) < args.reps and (len(times) < 2 or spent < args.budget_s):
                dist.barrier()
                t = time.perf_counter()
                once()
                dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
                dist.all_reduce(
                    dt, op=dist.ReduceOp.MAX
                )  # a collective ends when its last rank does
                times.append(float(dt))
                spent = time.perf_counter() - t_all
                flag = torch.tensor([spent], dtype=torch.float64)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same rep
                spent = float(flag)
            results.append({"op": op, "bytes": n * 4, "seconds": statistics.median(times),
                            "reps": len(times)})  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(args.result).write_text(json.dumps(results))
    return 0


def collectives(
    bed: TestBed, per_site: int, sizes: list[int], reps: int, budget_s: float, workdir: Path
) -> list[dict]:
    """Run every op at every size over ``per_site`` ranks in each site; median seconds each."""
    world = 2 * per_site
    port = free_port()
    result = workdir / f"coll-{per_site}.json"
    argvs = []
    for rank in range(world):
        site = SITES[rank // per_site]
        argvs.append(
            bed.exec_argv(
                site,
                {"OMP_NUM_THREADS": "1"},
                [sys.executable, __file__, "--worker", "--rank", str(rank), "--world", str(world),
                 "--master", f"{bed.addr['a']}:{port}", "--ops", ",".join(OPS),
                 "--sizes", ",".join(map(str, sizes)), "--reps", str(reps),
                 "--budget-s", str(budget_s), "--result", str(result)],
            )
        )  # fmt: skip
    _spawn(argvs, RUN_TIMEOUT)
    rows = json.loads(result.read_text())
    for r in rows:
        r["ranks"] = world
        r["per_site"] = per_site
    return rows


def cluster_dict(bed: TestBed, rtt: float, per_site: int) -> dict:
    """The cluster file that describes the bed: one node of ``per_site`` "GPUs" (CPU processes)
    per site, loopback inside a site (fast: never the limit), the shaped link between them."""
    return {
        "name": "netns-bed",
        "gpu": {"name": "cpu", "peak_bf16_tflops": 1, "memory_gib": 16, "hbm_tbytes_s": 0.02},
        "node": {"bandwidth_gbytes_s": 10, "latency_us": 20},
        "site": {"bandwidth_gbit_s": 100, "latency_us": 20},
        "sites": [{"name": s, "nodes": 1, "gpus_per_node": per_site} for s in SITES],
        "links": [
            {
                "sites": list(SITES),
                "bandwidth_gbit_s": bed.rate_mbit / 1000,
                "count": 1,
                "rtt_ms": rtt * 1e3,
                "transport": "tcp",
            }
        ],
    }


def write_nccl_log(path: Path, rows: list[dict], per_site: int) -> None:
    """Rows of one op as nccl-tests prints them (the format ``--calibrate`` reads)."""
    world = 2 * per_site
    lines = [f"# nccl-tests format, measured with gloo by scripts/bench_sites.py ({rows[0]['op']})"]
    for r in range(world):
        lines.append(f"#  Rank {r} Group 0 Pid {1000 + r} on site-{SITES[r // per_site]} device 0")
    lines.append("#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong")
    for row in rows:
        size, t = row["bytes"], row["seconds"]
        algbw = size / t / 1e9
        factor = {"all_reduce": 2 * (world - 1) / world, "sendrecv": 1.0}.get(
            row["op"], (world - 1) / world
        )
        busbw = algbw * factor
        cell = f"{t * 1e6:.2f} {algbw:.4f} {busbw:.4f} 0"
        lines.append(f"{size} {size // 4} float sum -1 {cell} {cell}")
    path.write_text("\n".join(lines) + "\n")


def compare_collectives(bed: TestBed, rtt: float, rows: list[dict], out: Path) -> list[dict]:
    """Measured against predicted for every row: default constants, then the link's efficiency
    and latency fitted to the two-rank all-reduce log alone (the other rows held out)."""
    sys.path.insert(0, str(ROOT))
    from porting.planner.calibrate import fit_levels, parse_nccl_test, predict_test
    from porting.planner.cluster import cluster_from_dict
    from porting.planner.comm import Efficiency

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tests = {}
    for per_site in sorted({r["per_site"] for r in rows}):
        for op in OPS:
            mine = [r for r in rows if r["per_site"] == per_site and r["op"] == op]
            name = f"link-a-b_{op}" + ("" if per_site == 1 else f"_{2 * per_site}ranks") + ".log"
            write_nccl_log(logs / name, mine, per_site)
            tests[(per_site, op)] = parse_nccl_test(logs / name)
    base = Efficiency()
    cluster1 = cluster_from_dict(cluster_dict(bed, rtt, 1))
    fitted, _ = fit_levels(cluster1, base, [tests[(1, "all_reduce")], tests[(1, "alltoall")]])
    table = []
    for r in rows:
        cl = cluster_from_dict(cluster_dict(bed, rtt, r["per_site"]))
        t = tests[(r["per_site"], r["op"])]
        before = predict_test(cl, base, t, r["bytes"])
        after = predict_test(cl, fitted, t, r["bytes"])
        table.append({**r, "predicted_default_s": before, "predicted_fitted_s": after,
                      "ratio_fitted": r["seconds"] / after,
                      "fit_row": r["per_site"] == 1 and r["op"] in ("all_reduce", "alltoall")})  # fmt: skip
    (out / "cluster.yaml").write_text(_yaml(cluster_dict(bed, rtt, 1)))
    (out / "constants.yaml").write_text(_yaml({"wan_tcp": fitted.wan_tcp,
                                               "wan_latency_scale": fitted.wan_latency_scale,
                                               "a2a_wan_bw": fitted.a2a_wan_bw,
                                               "a2a_latency": fitted.a2a_latency}))  # fmt: skip
    return table


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


# --- training -----------------------------------------------------------------------------------


def _tiny_checkpoint(workdir: Path) -> tuple[Path, Path]:
    """A tiny Llama imported with `porting import` and a corpus of its tokens (all local)."""
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from porting.testing import TRAIN_TEXT, make_indexed_dataset, make_llama

    hf = make_llama(workdir / "hf", num_layers=4, hidden_size=128, intermediate_size=256,
                    num_heads=4, num_kv_heads=4, vocab_size=512, tokenizer_vocab=500)  # fmt: skip
    ckpt = workdir / "ckpt"
    if not (ckpt / "context" / "porting.json").is_file():
        # the CLI, not the library call: its output stays ours (NeMo's start-up lines filtered)
        r = subprocess.run(
            [sys.executable, "-m", "porting.cli", "import", str(hf), "--out", str(ckpt)],
            capture_output=True, text=True, timeout=RUN_TIMEOUT,
        )  # fmt: skip
        if r.returncode:
            raise RuntimeError(f"porting import failed:\n{r.stderr[-3000:]}")
    tok = AutoTokenizer.from_pretrained(str(hf))
    data = make_indexed_dataset(workdir / "data" / "corpus_text_document", tok, [TRAIN_TEXT] * 400)
    return ckpt, data


TRAIN_LAYOUTS = {
    # name: (porting train flags, --layout for porting plan)
    "DP2": ([], "tp=1,pp=1,mb=2,recompute=none"),
    "PP2": (["--pp", "2"], "tp=1,pp=2,mb=2,recompute=none,order=default"),
}


def _train_flags(ckpt: Path, data: Path, out: Path, steps: int, extra: list[str]) -> list[str]:
    return ["-m", "porting.cli", "train", "--checkpoint", str(ckpt), "--data", str(data),
            "--out", str(out), "--seq-length", "128", "--micro-batch", "2", "--global-batch", "8",
            "--steps", str(steps), "--warmup", "1", "--save-every", "0", "--lr", "1e-3",
            "--no-distributed-optimizer", *extra]  # fmt: skip


def step_seconds(out: Path, skip: int) -> float:
    """Median step time of a run from its metrics (global batch tokens / tokens_per_s)."""
    import csv

    rates = {}
    for f in sorted(out.rglob("metrics.csv")):
        with open(f) as fh:
            for row in csv.DictReader(fh):
                if row.get("tokens_per_s") and row.get("global_step"):
                    rates[int(float(row["global_step"]))] = float(row["tokens_per_s"])
    steps = [s for s in sorted(rates) if s >= skip]
    if not steps:
        raise RuntimeError(f"{out}: no step timings in metrics.csv")
    return statistics.median(8 * 128 / rates[s] for s in steps)


def train_runs(bed: TestBed, workdir: Path, steps: int) -> list[dict]:
    """One site (two processes in site a) and two sites (a torchrun node in each) per layout."""
    ckpt, data = _tiny_checkpoint(workdir)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    rows = []
    for name, (flags, layout) in TRAIN_LAYOUTS.items():
        for sites in (1, 2):
            out = workdir / f"run-{name}-{sites}site"
            shutil.rmtree(out, ignore_errors=True)
            port = free_port()
            extra = list(flags)
            if name == "DP2":
                extra.append("--use-tp-pp-dp-mapping")
            if sites == 1:
                extra += ["--gpus-per-node", "2"]
                argv = [torchrun, "--nnodes=1", "--nproc-per-node=2",
                        f"--master-addr={bed.addr['a']}", f"--master-port={port}",
                        *_train_flags(ckpt, data, out, steps, extra)]  # fmt: skip
                argvs = [bed.exec_argv("a", env, argv)]
            else:
                extra += ["--nodes", "2", "--gpus-per-node", "1"]
                argvs = [
                    bed.exec_argv(
                        s, env,
                        [torchrun, "--nnodes=2", f"--node-rank={i}", "--nproc-per-node=1",
                         f"--master-addr={bed.addr['a']}", f"--master-port={port}",
                         *_train_flags(ckpt, data, out, steps, extra)],
                    )
                    for i, s in enumerate(SITES)
                ]  # fmt: skip
            t = time.perf_counter()
            _spawn(argvs, RUN_TIMEOUT)
            rows.append({"layout": name, "sites": sites, "plan_layout": layout,
                         "step_s": step_seconds(out, skip=2),
                         "wall_s": time.perf_counter() - t})  # fmt: skip
            print(f"  train {name} over {sites} site(s): {rows[-1]['step_s'] * 1e3:.1f} ms/step",
                  file=sys.stderr)  # fmt: skip
    return rows, ckpt


def predict_train(bed: TestBed, rtt: float, rows: list[dict], ckpt: Path, out: Path) -> list[dict]:
    """Each two-site run predicted after fitting compute to the one-site run of its layout."""
    sys.path.insert(0, str(ROOT))
    import yaml

    from porting.commands.plan import parse_layout
    from porting.planner.calibrate import fit_step, load_constants
    from porting.planner.cluster import cluster_from_dict
    from porting.planner.model import load_model
    from porting.planner.perf import Evaluator, Settings

    model = load_model(str(ckpt))
    eff = load_constants(out / "constants.yaml")
    # as the runs are made: fp32 on the CPU, no overlap, and the plain optimizer, whose gradient
    # all-reduce gloo implements as a ring; its reduce-scatter (the distributed optimizer's) costs
    # a whole all-reduce on gloo (the collective rows show it), which NCCL's does not
    settings = Settings(param_bytes=4, distributed_optimizer=False, flash_attention=False,
                        micro_batches=(2,), reserve_bytes=0)  # fmt: skip
    one = cluster_dict(bed, rtt, 2)
    one["sites"] = [{"name": "a", "nodes": 1, "gpus_per_node": 2}]
    one["links"] = []
    two = cluster_dict(bed, rtt, 1)
    (out / "cluster-one-site.yaml").write_text(yaml.safe_dump(one, sort_keys=False))
    table = []
    for name in TRAIN_LAYOUTS:
        single = next(r for r in rows if r["layout"] == name and r["sites"] == 1)
        double = next(r for r in rows if r["layout"] == name and r["sites"] == 2)
        ev1 = Evaluator(model, cluster_from_dict(one), 128, 8, settings, eff)
        lay1 = parse_layout(single["plan_layout"], ev1)
        fitted = fit_step(ev1, lay1, single["step_s"])
        ev2 = Evaluator(model, cluster_from_dict(two), 128, 8, settings, fitted)
        lay2 = parse_layout(double["plan_layout"], ev2)
        p = ev2.predict(lay2)
        table.append({"layout": name, "one_site_s": single["step_s"],
                      "two_sites_s": double["step_s"], "predicted_s": p.step,
                      "ratio": double["step_s"] / p.step, "compute_eff": fitted.compute,
                      "crossing": lay2.placement_label()})  # fmt: skip
    return table


# --- report -------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    """The tables docs/planner.md carries."""
    lines = [
        f"Link: {result['rate_mbit']} Mbit/s token bucket each way, RTT {result['rtt_ms']:.3f} ms "
        "(veth, not emulated); ratios are measured / predicted after fitting the link to the "
        "2-rank all-reduce and the all-to-all's constants to the 2-rank all-to-all (the rows "
        "marked *fit*).",
        "",
        "| op | ranks | bytes | measured ms | predicted ms (default) | predicted ms (fitted) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["collectives"]:
        mark = " *fit*" if r["fit_row"] else ""
        lines.append(
            f"| {r['op']}{mark} | {r['ranks']} | {r['bytes']:,} | {r['seconds'] * 1e3:.2f} | "
            f"{r['predicted_default_s'] * 1e3:.2f} | {r['predicted_fitted_s'] * 1e3:.2f} | "
            f"{r['ratio_fitted']:.2f} |"
        )
    if result.get("train"):
        lines += [
            "",
            "| layout | crossing the link | one site ms/step | two sites ms/step | predicted ms | ratio |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in result["train"]:
            lines.append(
                f"| {r['layout']} | {r['crossing']} | {r['one_site_s'] * 1e3:.1f} | "
                f"{r['two_sites_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['ratio']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Set up the bed, measure, compare, tear down; print the tables (or JSON)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=100, help="link bandwidth, each way")
    ap.add_argument("--sizes", default="65536,262144,1048576,4194304,8388608", help="message bytes")
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions per size (median)")
    ap.add_argument("--budget-s", type=float, default=8, help="time cap per op and size")
    ap.add_argument("--train", action="store_true", help="also time porting train runs")
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 reps (the suite's run)")
    ap.add_argument("--out", type=Path, help="keep logs, cluster file and results here")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--ops", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.sizes, args.reps, args.budget_s = "65536,1048576", 3, 3
    sizes = [int(s) for s in args.sizes.split(",")]
    if max(sizes) > MAX_BYTES or min(sizes) <= 0:
        ap.error(f"--sizes: each between 1 and {MAX_BYTES} bytes")
    if args.rate_mbit <= 0:
        ap.error("--rate-mbit must be positive")

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sites-")))
        out = args.out or work / "out"
        out.mkdir(parents=True, exist_ok=True)
        bed = TestBed(args.rate_mbit)
        stack.callback(bed.close)
        try:
            bed.open()
        except NoPrivilege as err:
            print(f"bench_sites: {err}", file=sys.stderr)
            return 3
        rtt = measure_rtt(bed)
        print(f"  link {args.rate_mbit} Mbit/s, RTT {rtt * 1e3:.3f} ms", file=sys.stderr)
        rows = []
        for per_site in (1, 2):
            rows += collectives(bed, per_site, sizes, args.reps, args.budget_s, work)
        result = {
            "rate_mbit": args.rate_mbit,
            "rtt_ms": rtt * 1e3,
            "namespaces": list(bed.ns.values()),
            "collectives": compare_collectives(bed, rtt, rows, out),
        }
        if args.train:
            runs, ckpt = train_runs(bed, work, args.train_steps)
            result["train"] = predict_train(bed, rtt, runs, ckpt, out)
        (out / "result.json").write_text(json.dumps(result, indent=2))
        (out / "result.md").write_text(markdown(result))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown(result), end="")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        # the with-block in main() has already killed the ranks and deleted the namespaces
        print("bench_sites: stopped; its processes and namespaces are gone", file=sys.stderr)
        sys.exit(130)
