"""Launch files for a chosen layout: ``porting train`` flags, a NeMo ``MegatronStrategy`` snippet,
per-node torchrun commands, a Slurm script, ``nccl.env`` and the nccl-tests that measure each level.

The files are one set (:func:`porting.shell.write_set`): staged, then renamed in together; every
value in them goes through :mod:`porting.shell` (a ``"$NAME"`` the scripts expand is a
:class:`~porting.shell.Ref`, never a string that begins with ``"$``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from porting import shell
from porting.errors import PortingError
from porting.planner.cluster import MIB, Cluster, NcclSettings, Site
from porting.planner.model import checkpoint_manifest
from porting.planner.perf import Evaluator, Prediction
from porting.planner.placement import ORDER_TP_PP_DP, WAN
from porting.planner.report import plan_dict, prediction_dict
from porting.planner.search import Plan
from porting.shell import Ref

MASTER_PORT = 29500
# what the emitted files expect in the environment unless --checkpoint / --data / --out are given
CHECKPOINT, DATA, OUT = Ref("CHECKPOINT"), Ref("DATA"), Ref("OUT")


def gpus_per_node(cluster: Cluster) -> int:
    """The one ``--gpus-per-node`` value ``porting train`` takes."""
    values = {s.gpus_per_node for s in cluster.sites}
    if len(values) != 1:
        raise PortingError(
            "sites differ in gpus_per_node "
            f"({', '.join(f'{s.name}: {s.gpus_per_node}' for s in cluster.sites)}); "
            "porting train takes one --gpus-per-node"
        )
    return values.pop()


def train_argv(
    p: Prediction,
    plan: Plan,
    checkpoint: str | Ref,
    data: str | Ref,
    out: str | Ref,
    plan_file: str | None = None,
) -> list[str | Ref]:
    """``porting train`` arguments for a layout (the flags the train entry must accept).

    Every setting the plan's prediction assumed is spelled out (rank order, distributed optimizer
    and its instances, overlaps, gradient-reduce dtype, micro-batch, recompute, VP), and
    ``--plan plan_file`` lets ``porting train`` refuse a checkpoint or flags the plan was not made
    for.
    """
    lay = p.layout
    s = plan.settings
    argv = [
        "--checkpoint", checkpoint,
        "--data", data,
        "--out", out,
        "--tp", str(lay.tp),
        "--pp", str(lay.pp),
    ]  # fmt: skip
    if lay.vp > 1:
        argv += ["--vp", str(lay.vp)]
    argv += ["--cp", str(lay.cp)]
    if lay.sequence_parallel:
        argv.append("--sequence-parallel")
    argv += [
        "--seq-length", str(plan.seq_length),
        "--micro-batch", str(lay.micro_batch),
        "--global-batch", str(plan.global_batch),
        "--nodes", str(plan.cluster.nodes),
        "--gpus-per-node", str(gpus_per_node(plan.cluster)),
    ]  # fmt: skip
    if plan.model.moe:
        argv += ["--ep", str(lay.ep), "--etp", str(lay.etp)]
    if p.order == ORDER_TP_PP_DP:
        argv.append("--use-tp-pp-dp-mapping")
    if lay.first_layers:
        argv += ["--first-stage-layers", str(lay.first_layers)]
        argv += ["--last-stage-layers", str(lay.last_layers)]
    if not s.distributed_optimizer:
        argv.append("--no-distributed-optimizer")
    argv += ["--num-distributed-optimizer-instances", str(lay.instances)]
    if s.overlap_grad_reduce:
        argv.append("--overlap-grad-reduce")
    if s.overlap_param_gather and s.distributed_optimizer:
        argv.append("--overlap-param-gather")
    if not s.grad_reduce_in_fp32:
        argv.append("--grad-reduce-in-bf16")
    argv += ["--recompute", lay.recompute]
    if plan_file:
        argv += ["--plan", plan_file]
    return argv


def _required_vars(argv: list[str | Ref]) -> list[str]:
    """Names of the shell variables the arguments refer to."""
    return [a.name for a in argv if isinstance(a, Ref)]


def _var_checks(argv: list[str | Ref]) -> str:
    return "\n".join(f': "${{{v}:?set {v}}}"' for v in _required_vars(argv))


def strategy_snippet(p: Prediction, plan: Plan) -> str:
    """Python that builds the NeMo 2.0 ``MegatronStrategy`` of the chosen layout."""
    lay, s = p.layout, plan.settings
    vp = lay.vp if lay.vp > 1 else None
    rc = {"none": None, "selective": "selective", "full": "full"}[lay.recompute]
    split = ""
    if lay.first_layers:
        split = (
            f" num_layers_in_first_pipeline_stage={lay.first_layers},"
            f" num_layers_in_last_pipeline_stage={lay.last_layers}."
        )
    sites = ", ".join(x.name for x in rank_cluster(plan, p).sites)
    m = plan.model
    moe = experts = ""
    if m.moe:
        moe = (
            f"\nMoE: num_moe_experts={m.experts}, moe_router_topk={m.top_k}, "
            f"moe_token_dispatcher_type={s.dispatcher!r}, moe_grouped_gemm={s.grouped_gemm} in "
            f"the model config; Megatron-LM: --num-experts {m.experts} --moe-router-topk "
            f"{m.top_k} --expert-model-parallel-size {lay.ep} --expert-tensor-parallel-size "
            f"{lay.etp} --moe-token-dispatcher-type {s.dispatcher}"
            + (" --moe-grouped-gemm." if s.grouped_gemm else ".")
        )
        experts = (
            f"    expert_model_parallel_size={lay.ep},\n"
            f"    expert_tensor_parallel_size={lay.etp},\n"
        )
    return f'''"""NeMo 2.0 strategy for {lay.label()} on {plan.cluster.name}, as planned by `porting plan`.

Model config: recompute_granularity={rc!r}{", recompute_method='uniform', recompute_num_layers=1" if rc == "full" else ""}.{split}
Data module: seq_length={plan.seq_length}, micro_batch_size={lay.micro_batch}, global_batch_size={plan.global_batch}.
Trainer: num_nodes={plan.cluster.nodes}, devices={gpus_per_node(plan.cluster)}; ranks ordered site by site ({sites}).{moe}
"""

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from nemo import lightning as nl

ddp = DistributedDataParallelConfig(
    use_distributed_optimizer={s.distributed_optimizer},
    grad_reduce_in_fp32={s.grad_reduce_in_fp32},
    overlap_grad_reduce={s.overlap_grad_reduce},
    overlap_param_gather={s.overlap_param_gather},
    num_distributed_optimizer_instances={lay.instances},
    check_for_nan_in_grad=True,
)

strategy = nl.MegatronStrategy(
    tensor_model_parallel_size={lay.tp},
    pipeline_model_parallel_size={lay.pp},
    virtual_pipeline_model_parallel_size={vp},
    context_parallel_size={lay.cp},
{experts}    sequence_parallel={lay.sequence_parallel},
    pipeline_dtype=torch.bfloat16,
    use_tp_pp_dp_mapping={p.order == ORDER_TP_PP_DP},
    num_distributed_optimizer_instances={lay.instances},
    ddp=ddp,
)
'''


def rank_cluster(plan: Plan, p: Prediction) -> Cluster:
    """The cluster with its sites in the order they take ranks for this placement."""
    return plan.cluster.reordered(p.layout.sites)


def _node_list(cluster: Cluster) -> list[tuple[str, int]]:
    """(site, index in site) for every node in rank order."""
    return [(s.name, i) for s in cluster.sites for i in range(s.nodes)]


def hosts_example(cluster: Cluster) -> str:
    """A hostfile template in rank order: replace the names, keep the order (site by site; in a
    site with racks or zones, domain by domain, each node named with its domains)."""
    order = " > ".join(s.name for s in cluster.sites)
    lines = [f"# one hostname per line, site by site in this order: {order}"]
    if any(s.domains for s in cluster.sites):
        lines.append(
            "# inside a site, nodes of one domain are consecutive (the names give each node's "
            "domains, outermost first): ranks fill a rack, then its zone, before the next"
        )
    by_name = {s.name: s for s in cluster.sites}
    lines += [host_name(by_name[site], i) for site, i in _node_list(cluster)]
    return "\n".join(lines) + "\n"


def host_name(site: Site, i: int) -> str:
    """The template name of node ``i`` of ``site``: its domains, outermost first."""
    where = "".join(f"-{d.name}{i // d.nodes:03d}" for d in reversed(site.domains))
    return f"{site.name}{where}-node{i:03d}"


def _torchrun(plan: Plan, node_rank: str, cmd: str) -> str:
    n = plan.cluster.nodes
    gpn = gpus_per_node(plan.cluster)
    return (
        f"torchrun --nnodes={n} --node-rank={node_rank} --nproc-per-node={gpn} "
        f'--master-addr="$MASTER_ADDR" --master-port="${{MASTER_PORT:-{MASTER_PORT}}}" '
        f"-m porting.cli train {cmd}"
    )


def torchrun_commands(plan: Plan, argv: list[str], cluster: Cluster | None = None) -> str:
    """One torchrun command per node, nodes in rank order (site by site, in ``cluster``'s order
    of the sites: the placement's)."""
    cluster = cluster or plan.cluster
    cmd = shell.command(argv)
    order = " > ".join(s.name for s in cluster.sites)
    lines = [
        f"# torchrun per node of {plan.cluster.name}, in node-rank order (site by site: {order}).",
        "# Run each line on the node named before it (names from hosts.example), after",
        "# `source nccl.env`, with MASTER_ADDR (node rank 0) and the variables the command uses set.",
    ]
    by_name = {s.name: s for s in cluster.sites}
    for rank, (site, i) in enumerate(_node_list(cluster)):
        lines.append(f"# {host_name(by_name[site], i)} (site {site}, node {i})")
        lines.append(_torchrun(plan, str(rank), cmd))
    return "\n".join(lines) + "\n"


def torchrun_script(plan: Plan, argv: list[str], cluster: Cluster | None = None) -> str:
    """``bash torchrun.sh NODE_RANK [FLAGS]`` on every node; ranks are given out site by site
    (in ``cluster``'s order of the sites: the placement's).

    FLAGS (``--steps 1000 --lr 3e-5``) are added to the planned ``porting train`` flags.
    """
    cmd = shell.command(argv)
    ranges, first = [], 0
    for s in (cluster or plan.cluster).sites:
        ranges.append(f"#   site {s.name}: node ranks {first}-{first + s.nodes - 1}")
        first += s.nodes
    n = plan.cluster.nodes
    return f"""#!/bin/bash
# torchrun on each node of {plan.cluster.name}: run `bash torchrun.sh NODE_RANK [FLAGS]` on every
# node; FLAGS (e.g. --steps 1000 --lr 3e-5) are added to the planned porting train flags
# (torchrun_per_node.txt lists each node's full command). Node ranks go site by site:
{chr(10).join(ranges)}
# A static node rank (no c10d rendezvous) keeps global ranks in that order.
set -euo pipefail
cd "$(dirname "$0")"
source ./nccl.env
: "${{MASTER_ADDR:?set MASTER_ADDR to the host of node rank 0}}"
{_var_checks(argv)}
NODE_RANK="${{1:?usage: torchrun.sh NODE_RANK [porting train flags]}}"
if ! [ "$NODE_RANK" -ge 0 ] 2>/dev/null || [ "$NODE_RANK" -ge {n} ]; then
  echo "node rank must be 0..{n - 1}" >&2
  exit 2
fi
shift
exec {_torchrun(plan, '"$NODE_RANK"', cmd)} "$@"
"""


def slurm_script(plan: Plan, argv: list[str]) -> str:
    """A Slurm batch script: node ranks from a site-ordered hostfile, torchrun.sh on each node."""
    n = plan.cluster.nodes
    gpn = gpus_per_node(plan.cluster)
    return f"""#!/bin/bash
#SBATCH --job-name=porting-train
#SBATCH --nodes={n}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpn}
#SBATCH --exclusive
# Submit from this directory (with the variables below set); arguments after the script's
# name are added to every rank's `porting train` (sbatch train.sbatch --steps 1000). HOSTFILE
# (default ./hosts) lists the allocated hosts site by site (see hosts.example); a node's rank is
# its line in that file, so ranks follow the sites whatever order Slurm lists the nodes in. Each
# node runs torchrun.sh.
set -euo pipefail
cd "${{SLURM_SUBMIT_DIR:-.}}"
HOSTFILE="${{HOSTFILE:-./hosts}}"
{_var_checks(argv)}
mapfile -t HOSTS < <(grep -v '^#' "$HOSTFILE" | sed '/^$/d')
if [ "${{#HOSTS[@]}}" -ne {n} ]; then
  echo "$HOSTFILE lists ${{#HOSTS[@]}} hosts, the plan needs {n}" >&2
  exit 2
fi
if [ "$(printf '%s\\n' "${{HOSTS[@]}}" | sort)" != "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sort)" ]; then
  echo "$HOSTFILE does not list exactly the allocated nodes" >&2
  exit 2
fi
# The first host's NodeAddr: a Slurm node's name need not resolve as a host name.
MASTER_ADDR=$(scontrol show node "${{HOSTS[0]}}" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)
export MASTER_ADDR="${{MASTER_ADDR:-${{HOSTS[0]}}}}" MASTER_PORT="${{MASTER_PORT:-{MASTER_PORT}}}" HOSTFILE
{"export " + " ".join(_required_vars(argv)) if _required_vars(argv) else ""}
srun --ntasks-per-node=1 bash -c \\
  'exec ./torchrun.sh "$(( $(grep -v "^#" "$HOSTFILE" | sed "/^$/d" | grep -nxF "$SLURMD_NODENAME" | cut -d: -f1) - 1 ))" "$@"' \\
  _ "$@"
"""


def nccl_settings(ev: Evaluator, p: Prediction) -> tuple[NcclSettings, list[str]]:
    """NCCL settings for the layout's inter-site flows, and how each value was derived."""
    base = ev.cluster.nccl
    lay = p.layout
    place = ev.topology_for(lay.sites).placement(
        lay.tp, lay.cp, lay.pp, lay.dp, lay.instances, p.order
    )
    why: list[str] = []
    buff, qps, threads, socks = base.buffsize, base.qps_per_connection, 1, 1
    flows_by_link: dict[str, tuple[object, int, str]] = {}
    group = place.cross if ev.settings.distributed_optimizer and lay.instances > 1 else place.dp
    if group.level == WAN:
        for link in group.links:
            flows_by_link[f"{link.a}-{link.b}"] = (link, group.count, "data-parallel gradients")
    for _level, link in place.pp_boundaries:
        if link is not None:
            flows_by_link.setdefault(f"{link.a}-{link.b}", (link, place.pp_count, "pipeline"))
    for name, (link, flows, what) in flows_by_link.items():
        share, tuned = ev.net.link_share(link, flows)
        buff = max(buff, tuned.buffsize)
        qps = max(qps, tuned.qps_per_connection)
        threads = max(threads, tuned.socket_threads)
        socks = max(socks, tuned.socks_per_thread)
        why.append(
            f"link {name} ({link.transport}, {link.count} x {link.bandwidth * 8 / 1e9:.0f} Gb/s, "
            f"RTT {link.rtt * 1e3:.2f} ms): {flows} concurrent {what} flows of "
            f"{share / 1e9:.2f} GB/s each; bandwidth-delay product per channel "
            f"{share * link.rtt / base.channels / MIB:.2f} MiB -> buffer {tuned.buffsize // MIB} MiB"
        )
    return (
        NcclSettings(
            buffsize=buff,
            channels=base.channels,
            qps_per_connection=qps,
            socket_threads=threads,
            socks_per_thread=socks,
        ),
        why,
    )


def nccl_env(ev: Evaluator, p: Prediction) -> str:
    """``nccl.env``: buffer from the bandwidth-delay product, QPs, TCP sockets, timeouts."""
    nccl, why = nccl_settings(ev, p)
    links = ev.cluster.links
    longest = max((ln.rtt for ln in links), default=0.0)
    tcp = any(ln.transport == "tcp" for ln in links)
    lines = [
        f"# NCCL settings for {p.layout.label()} on {ev.cluster.name} (porting plan).",
        "# NCCL keeps one NCCL_BUFFSIZE buffer (8 slots) in flight per channel and connection, so",
        "# one channel moves at most NCCL_BUFFSIZE per round trip; the buffer is sized to the",
        "# bandwidth-delay product of each inter-site flow. Each connection's buffers take GPU",
        "# memory (about 2 x channels x NCCL_BUFFSIZE per peer).",
    ]
    lines += [f"#   {w}" for w in why] or ["#   no inter-site traffic in this layout"]
    lines.append(f"export NCCL_BUFFSIZE={nccl.buffsize}")
    lines.append(f"export NCCL_MIN_NCHANNELS={nccl.channels}")
    lines += [
        "# several queue pairs per connection let ECMP spread one connection over parallel links",
        f"export NCCL_IB_QPS_PER_CONNECTION={nccl.qps_per_connection}",
        f"export NCCL_IB_SPLIT_DATA_ON_QPS={1 if nccl.qps_per_connection > 1 else 0}",
    ]
    # IB transport timeout is 4.096 us x 2^N; long RTTs under load need more than the default.
    timeout = 22 if longest > 1e-3 else 20
    lines += [
        f"export NCCL_IB_TIMEOUT={timeout}",
        "export NCCL_IB_RETRY_CNT=7",
    ]
    if tcp:
        lines += [
            "# TCP links: NCCL's socket transport, several threads and sockets per connection.",
            "# NCCL uses one network for a whole job: if sites are joined only by TCP, set",
            "# NCCL_NET=Socket (inside each site traffic then also goes over TCP).",
            f"export NCCL_SOCKET_NTHREADS={nccl.socket_threads}",
            f"export NCCL_NSOCKS_PERTHREAD={nccl.socks_per_thread}",
            "# export NCCL_NET=Socket",
        ]
    lines += [
        "# PyTorch: fail a stuck collective instead of hanging (minutes are generous for WAN)",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
    ]
    return "\n".join(lines) + "\n"


def nccl_tests_script(cluster: Cluster, moe: bool = False) -> str:
    """nccl-tests commands that measure each level; their logs feed ``--calibrate`` (with
    ``moe``, each level's all-to-all too: the MoE layers' dispatch and combine)."""
    gpn = gpus_per_node(cluster)
    first = cluster.sites[0]
    lines = [
        "#!/bin/bash",
        f"# Measure each level of {cluster.name} with nccl-tests; then",
        "#   porting plan ... --calibrate nccl-logs/ [--measured-step SECONDS]",
        "# Log names say the level: node_*, site-<site>_*, link-<a>-<b>_*. Host variables default",
        "# to the names in hosts.example; set them to real hosts.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        "source ./nccl.env",
        'NT="${NCCL_TESTS:-./build}"',
        "mkdir -p nccl-logs",
        "ARGS='-b 8 -e 4G -f 2 -g 1'",
        "# inside one node (NVLink)",
        f'mpirun -np {gpn} -H "${{NODE_A:-{host_name(first, 0)}}}:{gpn}" '
        f'"$NT/all_reduce_perf" $ARGS | tee nccl-logs/node_all_reduce.log',
    ]
    if moe:
        lines.append(
            f'mpirun -np {gpn} -H "${{NODE_A:-{host_name(first, 0)}}}:{gpn}" '
            f'"$NT/alltoall_perf" $ARGS | tee nccl-logs/node_alltoall.log'
        )
    for s in cluster.sites:
        if s.nodes < 2:
            continue
        var = s.name.upper().replace("-", "_")
        h0 = f"${{{var}_0:-{host_name(s, 0)}}}"
        h1 = f"${{{var}_1:-{host_name(s, 1)}}}"
        pair = (
            f'mpirun -np {2 * s.gpus_per_node} -H "{h0}:{s.gpus_per_node},{h1}:{s.gpus_per_node}"'
        )
        lines += [
            f"# between two nodes of site {s.name}",
            f'{pair} "$NT/all_reduce_perf" $ARGS | tee nccl-logs/site-{s.name}_all_reduce.log',
        ]
        if moe:
            lines.append(
                f'{pair} "$NT/alltoall_perf" $ARGS | tee nccl-logs/site-{s.name}_alltoall.log'
            )
    for ln in cluster.links:
        va, vb = (x.upper().replace("-", "_") for x in (ln.a, ln.b))
        by_name = {x.name: x for x in cluster.sites}
        ha = f"${{{va}_0:-{host_name(by_name[ln.a], 0)}}}"
        hb = f"${{{vb}_0:-{host_name(by_name[ln.b], 0)}}}"
        lines += [
            f"# across the {ln.a}-{ln.b} link: one node in each site",
            f'mpirun -np {2 * gpn} -H "{ha}:{gpn},{hb}:{gpn}" "$NT/all_reduce_perf" $ARGS '
            f"| tee nccl-logs/link-{ln.a}-{ln.b}_all_reduce.log",
            f'mpirun -np 2 -H "{ha}:1,{hb}:1" "$NT/sendrecv_perf" $ARGS '
            f"| tee nccl-logs/link-{ln.a}-{ln.b}_sendrecv.log",
        ]
        if moe:
            lines.append(
                f'mpirun -np {2 * gpn} -H "{ha}:{gpn},{hb}:{gpn}" "$NT/alltoall_perf" $ARGS '
                f"| tee nccl-logs/link-{ln.a}-{ln.b}_alltoall.log"
            )
    return "\n".join(lines) + "\n"


GEMM_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def gemm_bench_script(m, lay) -> str:
    """A standalone benchmark of the chosen layout's expert GEMMs (each GPU's local experts, the
    two weights of an expert at its ETP share) over the rows an expert may get, grouped (one
    launch, ``torch._grouped_mm`` where the build has it) and looped (a launch per expert); its
    log feeds ``--calibrate`` with the nccl-tests logs."""
    width = m.moe_ffn // lay.etp
    shapes = [(m.hidden, (2 if m.gated else 1) * width), (width, m.hidden)]
    return f'''#!/usr/bin/env python3
"""Time the planned model's expert GEMMs (MODEL, as LAYOUT runs them: GROUPS local experts,
the weights SHAPES, in bf16). Then
    porting plan ... --calibrate nccl-logs/
Usage: python3 gemm_bench.py [--device cuda] [--out nccl-logs/grouped_gemm.csv] [--rows 16,32,...]
"""
import argparse
import os
import time

import torch

# the model's name comes from its file or directory: a string here, never code
MODEL = {m.name!r}
LAYOUT = {lay.label()!r}
GROUPS = {m.experts // lay.ep}
SHAPES = {shapes!r}  # (k, n)
ROWS = {",".join(str(r) for r in GEMM_ROWS)!r}


def row_list(text):
    """``16,32,...``: positive integers, or argparse's one-line error."""
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {{text!r}}") from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"rows must be positive: {{text!r}}")
    return rows


def timed(fn, device, repeat):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeat


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "nccl-logs", "grouped_gemm.csv"))
    ap.add_argument("--rows", default=ROWS, type=row_list, help="rows per expert to time")
    ap.add_argument("--groups", type=int, default=GROUPS)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--scale", type=int, default=1, help="divide k and n (a quick rehearsal)")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    grouped_mm = getattr(torch, "_grouped_mm", None) if a.device == "cuda" else None
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"# {{torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}}, "
                f"torch {{torch.__version__}}, {{dtype}}\\n")
        f.write("groups,m,n,k,grouped,ms\\n")
        for k, n in SHAPES:
            k, n = k // a.scale, n // a.scale
            w = torch.randn(a.groups, k, n, device=a.device, dtype=dtype)
            for rows in a.rows:
                x = torch.randn(a.groups * rows, k, device=a.device, dtype=dtype)
                parts = x.split(rows)
                looped = timed(lambda: [p @ w[i] for i, p in enumerate(parts)], a.device, a.repeat)
                f.write(f"{{a.groups}},{{rows}},{{n}},{{k}},0,{{looped * 1e3:.6f}}\\n")
                if grouped_mm is not None:
                    offs = torch.arange(rows, rows * a.groups + 1, rows, device=a.device,
                                        dtype=torch.int32)
                    t = timed(lambda: grouped_mm(x, w, offs=offs), a.device, a.repeat)
                    f.write(f"{{a.groups}},{{rows}},{{n}},{{k}},1,{{t * 1e3:.6f}}\\n")
                print(f"k={{k}} n={{n}} rows={{rows}}: looped {{looped * 1e3:.3f}} ms", flush=True)
    os.replace(tmp, a.out)
    print(f"wrote {{a.out}}")


if __name__ == "__main__":
    main()
'''


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to a temporary file next to ``path`` and rename it into place (the
    temporary file removed if writing fails)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def default_checkpoint(model_spec: str) -> str | Ref:
    """The ``--model`` argument when it is an imported checkpoint, else a shell variable."""
    path = Path(model_spec)
    if checkpoint_manifest(path) is not None:
        return str(path.resolve())
    return CHECKPOINT


def write_launch(
    out_dir: str | os.PathLike,
    plan: Plan,
    ev: Evaluator,
    p: Prediction | None = None,
    *,
    checkpoint: str | Ref = CHECKPOINT,
    data: str | Ref = DATA,
    run_dir: str | Ref = OUT,
) -> list[Path]:
    """Write every launch file for ``p`` (default: the best layout) into ``out_dir``, as one
    set: on a failure none of them is new."""
    p = p or plan.best
    out = Path(out_dir)
    argv = train_argv(p, plan, checkpoint, data, run_dir, str(out.resolve() / "plan.json"))
    ranks = rank_cluster(plan, p)
    chosen = plan_dict(plan, top=0)
    chosen["layouts"] = [prediction_dict(p)]
    chosen["train_argv"] = [str(a) for a in argv]
    files = {
        "plan.json": (json.dumps(chosen, indent=2, default=str) + "\n", 0o644),
        "train_flags.txt": (shell.command(argv) + "\n", 0o644),
        "strategy.py": (strategy_snippet(p, plan), 0o644),
        "torchrun.sh": (torchrun_script(plan, argv, ranks), 0o755),
        "torchrun_per_node.txt": (torchrun_commands(plan, argv, ranks), 0o644),
        "train.sbatch": (slurm_script(plan, argv), 0o755),
        "hosts.example": (hosts_example(ranks), 0o644),
        "nccl.env": (nccl_env(ev, p), 0o644),
        "nccl_tests.sh": (nccl_tests_script(plan.cluster, moe=plan.model.moe), 0o755),
    }
    if plan.model.moe:
        files["gemm_bench.py"] = (gemm_bench_script(plan.model, p.layout), 0o755)
    return shell.write_set(out, files, "--emit")
