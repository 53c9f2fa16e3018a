"""Step time and memory per GPU of one layout: the model the search ranks layouts by.

Sources of the formulas (each repeated where it is used):

- FLOPs: Narayanan et al., SC'21, eq. 3 (``96 B s l h^2 (1 + s/6h + V/16lh)`` with full
  recomputation), generalised to GQA and gated MLPs through the matmul parameter count.
- Activation memory: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models" (MLSys 2023), Table 2 (``s b h (34 + 5 a s / h)`` per layer, split into the part
  tensor parallelism shards and the part only sequence parallelism shards); in-flight
  microbatches per stage from Megatron-Core's schedules (``schedules.py``: ``p - rank`` for
  1F1B, ``2(p - rank - 1) + (v - 1) p + 1`` model chunks for the interleaved schedule).
- Weights and optimizer: 2 (bf16 weights) + 4 (fp32 main gradients) + 12 (fp32 master weights,
  Adam m and v) bytes per parameter, the 12 sharded over the distributed optimizer's data-parallel
  ranks (Megatron-LM ``theoretical_memory_usage.py``: ``18`` or ``6 + 12 / d``).
- Pipeline bubble: ``(p - 1) / v`` stage-times per step (Narayanan et al. section 2.2).
- Communication: alpha-beta ring/tree costs (``comm.py``) per group, with the overlaps Megatron
  performs: gradient reduce-scatter during the last microbatch's backward
  (``overlap_grad_reduce``), parameter all-gather during the next forward
  (``overlap_param_gather``), context-parallel KV exchange behind attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from porting.errors import PortingError
from porting.planner.alltoall import deduplicated_time, per_copy_time, routing_spread
from porting.planner.cluster import GIB, Cluster
from porting.planner.comm import (
    Efficiency,
    Network,
    all_gather,
    allreduce,
    p2p,
    reduce_scatter,
)
from porting.planner.experts import ExpertCost, expert_layer_cost
from porting.planner.model import ModelShape
from porting.planner.placement import LEVEL_NAMES, ORDER_DEFAULT, ORDER_TP_PP_DP, Topology

RECOMPUTE = ("none", "selective", "full")
# Megatron-Core's token dispatchers the all-to-all model covers: "alltoall" (its default: a copy
# per routed expert) and "flex" with DeepEP (a copy per node, forwarded inside it)
DISPATCHERS = ("alltoall", "flex")
# Adam step traffic per parameter of the local shard: read the gradient (4), read and write the
# fp32 master weight (8), m (8) and v (8), write the bf16 weight (2).
OPTIMIZER_BYTES_PER_PARAM = 30
# Megatron's default gradient bucket: max(40M, 1M x data-parallel size) parameters
# (megatron/core/distributed/distributed_data_parallel.py).
BUCKET_PARAMS = 40_000_000


@dataclass(frozen=True)
class Settings:
    """How training runs; defaults follow ``porting train`` (porting/train/recipe.py's DDP config)."""

    sequence_parallel: bool = True  # used whenever TP > 1
    flash_attention: bool = True  # fused attention: no s x s scores stored or streamed
    distributed_optimizer: bool = True
    instances: int | None = None  # distributed-optimizer instances; None: one per site
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    overlap_p2p: bool = False
    tp_comm_overlap: bool = False
    # Narayanan et al. section 4.1: without SP, send 1/TP of a stage's output between nodes and
    # all-gather it over NVLink (Megatron-LM of 2021; with SP the tensor is sharded anyway).
    p2p_scatter_gather: bool = False
    grad_reduce_in_fp32: bool = True
    param_bytes: int = 2
    reserve_bytes: float = 3 * GIB  # CUDA context, NCCL buffers, cuBLAS workspace, fragmentation
    # Megatron rank orders the search places layouts with (both by default: the plan shows why
    # one wins); ``--order`` narrows it to one.
    orders: tuple[str, ...] = (ORDER_TP_PP_DP, ORDER_DEFAULT)
    uneven_pipeline: bool = True  # PP sizes that do not divide the layers, first/last stage set
    tune_nccl: bool = True
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = RECOMPUTE
    context_parallel: tuple[int, ...] = (1, 2, 4, 8)
    max_vp: int = 8
    # MoE: expert-parallel sizes to try (empty: every divisor of the experts that fits) and the
    # token dispatcher the all-to-all is predicted for
    expert_parallel: tuple[int, ...] = ()
    dispatcher: str = "alltoall"
    # Megatron's --moe-grouped-gemm (TEGroupedMLP): the local experts' GEMMs in one launch
    grouped_gemm: bool = True


@dataclass(frozen=True)
class Layout:
    """One way to split the model and the batch over the cluster, and to place it.

    ``order`` is Megatron's rank order; ``sites`` the order in which the sites' nodes take ranks
    (empty: the cluster file's order), which decides the links a pipeline crosses under the
    default order; ``first_layers`` / ``last_layers`` (0: even split) are Megatron's
    ``num_layers_in_first/last_pipeline_stage`` for a PP size that does not divide the layers.
    """

    tp: int
    cp: int
    pp: int
    vp: int
    dp: int
    micro_batch: int
    recompute: str
    instances: int = 1
    sequence_parallel: bool = False
    order: str = ORDER_TP_PP_DP
    sites: tuple[str, ...] = ()
    first_layers: int = 0
    middle_layers: int = 0
    last_layers: int = 0
    ep: int = 1  # expert-parallel size (MoE layers; Megatron's expert grid shares only PP)
    etp: int = 1  # expert tensor-parallel size

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the MoE layers' replicas of each expert shard."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def label(self) -> str:
        """Short form for tables: ``TP8 PP4 VP5 CP1 DP16 mb1 sel`` (``PP3 L26/27/27``: layers of
        the first, each middle and the last stage where they differ)."""
        vp = f" VP{self.vp}" if self.vp > 1 else ""
        pp = f"PP{self.pp}"
        if self.first_layers:
            mid = self.middle_layers
            pp += (
                f" L{self.first_layers}/{mid}/{self.last_layers}"
                if self.pp > 2
                else (f" L{self.first_layers}/{self.last_layers}")
            )
        rc = {"none": "none", "selective": "sel", "full": "full"}[self.recompute]
        ep = f" EP{self.ep} ETP{self.etp}" if self.ep > 1 or self.etp > 1 else ""
        return f"TP{self.tp} {pp}{vp} CP{self.cp}{ep} DP{self.dp} mb{self.micro_batch} {rc}" + (
            f" I{self.instances}" if self.instances > 1 else ""
        )

    def stage_layers(self, layers: int) -> list[int]:
        """Decoder layers of each pipeline stage, first to last."""
        if not self.first_layers:
            return [layers // self.pp] * self.pp
        return [self.first_layers] + [self.middle_layers] * (self.pp - 2) + [self.last_layers]

    def placement_label(self) -> str:
        """Which parallel dimension crosses the sites, and the sites' order for a pipeline."""
        if self.order == ORDER_TP_PP_DP or self.pp == 1:
            return "data-parallel across sites"
        return "pipeline across sites" + (f" {'>'.join(self.sites)}" if self.sites else "")


@dataclass
class Memory:
    """Bytes per GPU on the most loaded pipeline stage, by part."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    other: float
    stage: int = 0

    @property
    def total(self) -> float:
        """Sum of the parts."""
        return self.weights + self.grads + self.optimizer + self.activations + self.other


@dataclass
class Prediction:
    """Predicted step time, throughput and memory of one layout, with its parts."""

    layout: Layout
    step: float
    tokens_per_s: float
    mfu: float
    memory: Memory
    parts: dict[str, float]
    exposed: dict[str, float]
    hidden: dict[str, float]
    order: str
    num_microbatches: int
    slowdown: float | None = None
    notes: list[str] = field(default_factory=list)


class Infeasible(Exception):
    """A layout that cannot run; the message says why (shown with ``--rejected``)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def layer_activation_bytes(
    m: ModelShape,
    tokens: int,
    seq: int,
    tp: int,
    sp: bool,
    *,
    scores: bool,
) -> tuple[float, float]:
    """Bytes one layer stores for backward for one microbatch: (SP-sharded part, TP part).

    Korthikanti et al. Table 2 term by term, with bf16 tensors (2 bytes) and 1-byte dropout
    masks. The first part (norm inputs, the GEMM inputs after each norm, dropout masks) is
    replicated over TP ranks unless sequence parallelism shards it; the second part (Q, K, V,
    attention output, MLP activation input and output) is always TP-sharded. For GPT (4h GELU
    MLP, MHA) this is ``10 sbh`` and ``24 sbh`` (+ ``5 a s^2 b`` for stored scores).
    """
    h = m.hidden
    rep = 2 * tokens * h * m.norms_per_layer  # norm inputs
    rep += 2 * tokens * h  # QKV input (first norm's output)
    if not m.parallel_attn or m.norms_per_layer == 2:
        rep += 2 * tokens * h  # fc1 input (second norm's output)
    if m.dropout:
        rep += 2 * tokens * h  # masks of the two residual dropouts
    sh = 2 * tokens * (m.q_width + m.kv_width)  # Q and K for the score GEMM
    sh += 2 * tokens * m.kv_heads * m.v_head_dim  # V
    sh += 2 * tokens * m.v_width  # attention output = projection input
    g = 2 if m.gated else 1
    if m.moe:
        # every routed copy: the dispatched input kept for the expert GEMM's backward and the
        # permuted output for the combine, then the expert's activation input and output; the
        # shared experts as a dense MLP; fp32 router logits
        width = g * m.moe_ffn + m.moe_ffn
        sh += 2 * tokens * m.top_k * (2 * h + width)
        sh += 2 * tokens * (g * m.shared_ffn + m.shared_ffn) + 4 * tokens * m.experts
    else:
        sh += 2 * tokens * m.ffn * g  # activation input
        sh += 2 * tokens * m.ffn  # activation output = fc2 input
    if scores:
        # softmax output (2 bytes), dropout mask (1) and dropout output (2) per score
        sh += (5 if m.dropout else 2) * m.heads * tokens * seq
    return rep / (tp if sp else 1), sh / tp


def inflight_chunks(pp: int, vp: int, rank: int, microbatches: int) -> int:
    """Model chunks whose activations a pipeline rank holds at its peak (Megatron schedules)."""
    if pp == 1:
        return 1
    if vp == 1:
        return min(microbatches, pp - rank)
    return min(microbatches * vp, 2 * (pp - rank - 1) + (vp - 1) * pp + 1)


def stage_params(
    m: ModelShape,
    tp: int,
    pp: int,
    stage: int,
    layers: int | None = None,
    ep: int = 1,
    etp: int = 1,
) -> float:
    """Parameters one GPU of pipeline stage ``stage`` holds (TP-sharded where Megatron shards);
    ``layers``: the stage's decoder layers where the split is uneven."""
    dense, experts = stage_param_split(m, tp, pp, stage, layers, ep, etp)
    return dense + experts


def stage_param_split(
    m: ModelShape,
    tp: int,
    pp: int,
    stage: int,
    layers: int | None = None,
    ep: int = 1,
    etp: int = 1,
) -> tuple[float, float]:
    """(parameters sharded by TP, routed experts' parameters sharded by EP x ETP) one GPU of
    pipeline stage ``stage`` holds. An MoE model's stage is counted as if every layer were its
    heavier kind per GPU: MoE layers, or dense ones (DeepSeek's first three) where a large EP
    leaves less of an MoE layer on each GPU than a dense MLP."""
    here = m.layers // pp if layers is None else layers
    if not m.moe:
        return _with_ends(here * m.params_per_layer() / tp, m, tp, pp, stage), 0.0
    dense, experts = m.layer_params()
    if m.moe_layers < m.layers and m.dense_layer_params() / tp > dense / tp + experts / (ep * etp):
        # a dense layer (DeepSeek's first three) holds more per GPU than an MoE layer split
        # over a large EP: the stage is counted as dense layers
        return _with_ends(here * m.dense_layer_params() / tp, m, tp, pp, stage), 0.0
    return _with_ends(here * dense / tp, m, tp, pp, stage), here * experts / (ep * etp)


def _with_ends(n: float, m: ModelShape, tp: int, pp: int, stage: int) -> float:
    """``n`` plus the embedding, final norm and output layer parameters on ``stage``."""
    if stage == 0:
        n += m.padded_vocab(tp) * m.hidden / tp + m.learned_positions * m.hidden
    if stage == pp - 1:
        n += m.hidden * (2 if m.layernorm else 1)
        if not m.tied or pp > 1:
            # untied output layer, or the tied copy Megatron keeps on the last stage
            n += m.padded_vocab(tp) * m.hidden / tp
    return n


def memory(
    m: ModelShape,
    layout: Layout,
    seq: int,
    microbatches: int,
    settings: Settings,
    stage: int,
) -> Memory:
    """Memory per GPU of pipeline stage ``stage``."""
    tp, cp, pp, vp = layout.tp, layout.cp, layout.pp, layout.vp
    sp = layout.sequence_parallel
    here = layout.stage_layers(m.layers)[stage]
    params, expert_params = stage_param_split(m, tp, pp, stage, here, layout.ep, layout.etp)
    grad_bytes = 4 if settings.grad_reduce_in_fp32 else settings.param_bytes
    shard = expert_shard = 1
    if settings.distributed_optimizer:
        shard = layout.dp * cp // layout.instances
        # the experts' optimizer state is sharded over their own data-parallel group (each
        # distributed-optimizer instance's share of it)
        expert_shard = max(1, layout.edp // layout.instances)
    optimizer = params * 12 / shard
    if expert_params:
        optimizer += expert_params * 12 / expert_shard
        params += expert_params
    tokens = layout.micro_batch * seq // cp
    scores = layout.recompute == "none" and not settings.flash_attention
    rep, sh = layer_activation_bytes(m, tokens, seq, tp, sp, scores=scores)
    per_layer = rep + sh
    chunk_layers = here // vp
    chunks = inflight_chunks(pp, vp, stage, microbatches)
    if layout.recompute == "full":
        # Only each layer's input stays; one layer is rebuilt at a time during backward.
        kept = 2 * tokens * m.hidden / (tp if sp else 1)
        acts = chunks * chunk_layers * kept + per_layer
    else:
        acts = chunks * chunk_layers * per_layer
    sp_div = tp if sp else 1
    if stage == 0:
        # token ids (int64) and the embedding dropout mask, per in-flight microbatch
        in_flight = min(microbatches, pp) if pp > 1 else 1
        acts += in_flight * (8 * tokens + (tokens * m.hidden if m.dropout else 0)) / sp_div
    if stage == pp - 1:
        # final norm output and fp32 logits for the cross-entropy (vocab-parallel)
        acts += 4 * tokens * m.hidden / sp_div + 4 * tokens * m.padded_vocab(tp) / tp
    return Memory(
        weights=params * settings.param_bytes,
        grads=params * grad_bytes,
        optimizer=optimizer,
        activations=acts,
        other=settings.reserve_bytes,
        stage=stage,
    )


def peak_memory(
    m: ModelShape, layout: Layout, seq: int, microbatches: int, settings: Settings
) -> Memory:
    """The most loaded stage: the first (most microbatches in flight), the last (logits) or, where
    the split is uneven, the second (more layers than the first, one microbatch fewer)."""
    stages = {0, layout.pp - 1}
    if layout.first_layers and layout.pp > 2:
        stages.add(1)
    parts = [memory(m, layout, seq, microbatches, settings, i) for i in sorted(stages)]
    return max(parts, key=lambda x: x.total)


@dataclass(frozen=True)
class _LayerCost:
    """One layer, one micro-batch, one GPU (seconds; an MoE model's the mean over its dense and
    MoE layers): what :meth:`Evaluator.predict` builds the step from."""

    gemm: float  # the dense GEMMs, one forward
    attn: float  # the attention score and value GEMMs, one forward
    mem_pass: float  # the memory-bound kernels, forward and backward
    share: float  # MoE layers over all layers
    experts: ExpertCost | None
    fwd: float
    bwd: float
    recompute: float
    tp_comm: float
    tp_exp: float
    cp_comm: float
    cp_exp: float
    ep_comm: float
    ep_level: int

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.tp_exp + self.cp_exp + self.ep_comm


class Evaluator:
    """Predicts layouts of one model on one cluster; caches what layouts share."""

    def __init__(
        self,
        model: ModelShape,
        cluster: Cluster,
        seq_length: int,
        global_batch: int,
        settings: Settings | None = None,
        eff: Efficiency | None = None,
    ):
        self.model = model
        self.cluster = cluster
        self.seq = seq_length
        self.global_batch = global_batch
        self.settings = settings or Settings()
        self.eff = eff or Efficiency()
        self.gpu = cluster.slowest_gpu()
        self.topology = Topology(cluster)
        self._topologies: dict[tuple[str, ...], Topology] = {}
        self._experts: dict[tuple[int, ...], ExpertCost] = {}
        self._file_order = tuple(x.name for x in cluster.sites)
        self.net = Network(cluster, self.eff, tune=self.settings.tune_nccl)
        self.evaluated = 0

    def topology_for(self, sites: tuple[str, ...]) -> Topology:
        """Where every rank sits when the sites take ranks in the order ``sites``."""
        if len(self.cluster.sites) == 1 or not sites or tuple(sites) == self._file_order:
            return self.topology
        hit = self._topologies.get(sites)
        if hit is None:
            hit = self._topologies[sites] = Topology(self.cluster.reordered(sites))
        return hit

    def instances_for(
        self,
        tp: int,
        cp: int,
        pp: int,
        order: str = ORDER_TP_PP_DP,
        sites: tuple[str, ...] = (),
    ) -> int:
        """Distributed-optimizer instances: the fewest that keep each instance inside a site.

        Megatron splits each data-parallel group into equal contiguous instances. With the
        tp-cp-ep-pp-dp order and ranks given out site by site, an instance stays inside a site
        when its size divides every site's number of model replicas: DP / gcd(replicas per site)
        (one per site for equal sites). Under the default order a data-parallel group is one
        pipeline stage's block of ranks, which may span sites or not; the fewest instances
        whose groups stay inside a site are found from the placement itself.
        """
        s = self.settings
        mp = tp * cp * pp
        dp = self.cluster.world // mp
        if not s.distributed_optimizer:
            return 1
        if s.instances is not None:
            return s.instances
        if order == ORDER_TP_PP_DP or pp == 1:
            per_site = [site.gpus // mp for site in self.cluster.sites]
            if any(site.gpus % mp for site in self.cluster.sites):
                return 1
            return dp // math.gcd(*per_site)
        return self.topology_for(sites).fewest_instances(tp, cp, pp, dp, order)

    def predict(self, layout: Layout, order: str | None = None) -> Prediction:
        """Step time, throughput and memory of ``layout``; raises Infeasible with the reason."""
        self.evaluated += 1
        m, s, gpu = self.model, self.settings, self.gpu
        tp, cp, pp, vp, dp = layout.tp, layout.cp, layout.pp, layout.vp, layout.dp
        seq = self.seq
        order = order or layout.order
        per_step = self.global_batch // (layout.micro_batch * dp)
        mem = peak_memory(m, layout, seq, per_step, s)
        if mem.total > gpu.memory_bytes:
            raise Infeasible(
                f"needs {mem.total / GIB:.1f} GiB per GPU on stage {mem.stage} "
                f"(weights {mem.weights / GIB:.1f}, grads {mem.grads / GIB:.1f}, optimizer "
                f"{mem.optimizer / GIB:.1f}, activations {mem.activations / GIB:.1f}, other "
                f"{mem.other / GIB:.1f}) > {gpu.memory_bytes / GIB:.0f} GiB"
            )
        try:
            place = self.topology_for(layout.sites).placement(
                tp, cp, pp, dp, layout.instances, order, layout.ep, layout.etp
            )
        except PortingError as err:
            # a group whose neighbours sit in two sites with no link between them
            raise Infeasible(f"{err} (traffic is not routed through a third site)") from None
        exposed = [0.0, 0.0, 0.0]
        hidden = [0.0, 0.0, 0.0]
        c = self._layer_cost(layout, place)
        tokens = layout.micro_batch * seq // cp
        peak = gpu.peak_flops * self.eff.compute
        stage_split = layout.stage_layers(m.layers)
        per_stage_layers = max(stage_split)
        logits = 6 * tokens * m.hidden * m.padded_vocab(tp) / tp / peak
        logits += 3 * 4 * tokens * m.padded_vocab(tp) / tp / gpu.hbm_bytes_s
        # The slowest stage sets the pace of the steady state; the bubble costs the average.
        stage_times = [n * c.total for n in stage_split]
        stage_times[-1] += logits
        t_last = max(stage_times)
        t_avg = sum(stage_times) / pp
        p2p_max, p2p_avg = self._pipeline_p2p(
            layout, place, per_stage_layers * c.total, per_step, exposed, hidden
        )
        slots = per_step * (t_last + p2p_max) + (pp - 1) / vp * (t_avg + p2p_avg)
        grad_exp, gather_exp, optimizer = self._gradient_sync(
            layout, place, stage_split, c, exposed, hidden
        )
        n_mb = per_step * per_stage_layers
        tp_lv = place.tp.level
        exposed[tp_lv] += n_mb * c.tp_exp
        hidden[tp_lv] += n_mb * (c.tp_comm - c.tp_exp)
        if cp > 1:
            exposed[place.cp.level] += n_mb * c.cp_exp
            hidden[place.cp.level] += n_mb * (c.cp_comm - c.cp_exp)
        if c.ep_comm:
            exposed[c.ep_level] += n_mb * c.ep_comm
        step = slots + grad_exp + gather_exp + optimizer
        ex = c.experts
        parts = {
            "compute": per_step * (per_stage_layers * 3 * (c.gemm + c.attn) + logits),
            **(
                {
                    "expert GEMMs": n_mb * c.share * (ex.forward + ex.backward),
                    "routing": n_mb * c.share * (ex.routing_forward + ex.routing_backward),
                }
                if ex
                else {}
            ),
            "memory-bound": n_mb * c.mem_pass,
            "recompute": n_mb * c.recompute,
            "tp/cp comm": n_mb * (c.tp_exp + c.cp_exp),
            **({"ep comm": n_mb * c.ep_comm} if m.moe else {}),
            "pp comm": per_step * p2p_max + (pp - 1) / vp * p2p_avg,
            "bubble": (pp - 1) / vp * t_avg,
            "dp comm": grad_exp + gather_exp,
            "optimizer": optimizer,
        }
        tokens_step = self.global_batch * seq
        world = dp * tp * cp * pp
        mfu = m.model_flops_per_token(seq) * tokens_step / (step * world * gpu.peak_flops)
        return Prediction(
            layout=layout,
            step=step,
            tokens_per_s=tokens_step / step,
            mfu=mfu,
            memory=mem,
            parts=parts,
            exposed=dict(zip(LEVEL_NAMES, exposed, strict=True)),
            hidden=dict(zip(LEVEL_NAMES, hidden, strict=True)),
            order=order,
            num_microbatches=per_step,
        )

    def _layer_cost(self, layout: Layout, place) -> _LayerCost:
        """One layer, one micro-batch, one GPU: its compute, memory-bound passes, recompute and
        the TP, CP and EP traffic of its passes."""
        m, s, eff, gpu, net = self.model, self.settings, self.eff, self.gpu, self.net
        tp, cp, seq = layout.tp, layout.cp, self.seq
        peak = gpu.peak_flops * eff.compute
        tokens = layout.micro_batch * seq // cp
        # the routed experts' GEMMs go by their shape (experts.py), the rest at the dense rate;
        # an MoE model's layer is the mean over its dense and MoE layers
        share = m.moe_layers / m.layers if m.moe else 0.0
        routed = share * m.top_k * m.expert_params()
        gemm = 2 * tokens * (m.matmul_params_per_layer() - routed) / tp / peak
        attn = 2 * tokens * seq * m.score_width / tp / peak
        rep, sh = layer_activation_bytes(
            m, tokens, seq, tp, layout.sequence_parallel, scores=not s.flash_attention and cp == 1
        )
        ex = self.experts(layout)
        if m.moe:
            # the routed copies' dispatched input and permuted output are moved by the
            # permutation, which ex.routing_* counts
            sh -= 2 * tokens * m.top_k * 2 * m.hidden / tp
        mem_pass = eff.memory_passes * (rep + sh) / gpu.hbm_bytes_s  # forward + backward
        ex_f = share * (ex.forward + ex.routing_forward) if ex else 0.0
        ex_b = share * (ex.backward + ex.routing_backward) if ex else 0.0
        fwd = gemm + attn + ex_f + mem_pass / 3
        bwd = 2 * (gemm + attn) + ex_b + 2 * mem_pass / 3
        recompute = {"full": fwd, "selective": attn}.get(layout.recompute, 0.0)
        # TP: per pass, 2 all-reduces (or 2 all-gathers + 2 reduce-scatters with SP)
        tp_one = 0.0
        if tp > 1:
            act = tokens * m.hidden * s.param_bytes
            tp_one = m.tp_collectives_per_layer() * reduce_scatter(tp, act, net.path(place.tp))
        passes = 3 if layout.recompute == "full" else 2
        tp_comm = passes * tp_one
        tp_exp = max(0.0, tp_comm - (gemm * (passes + 1))) if s.tp_comm_overlap else tp_comm
        # CP: ring exchange of K and V chunks, behind the attention kernel
        cp_comm = cp_exp = 0.0
        if cp > 1:
            kv = 2 * tokens * m.kv_width / tp * s.param_bytes
            sends = (cp - 1) * (3 + (1 if layout.recompute == "full" else 0))
            cp_comm = sends * p2p(kv, net.path(place.cp))
            cp_exp = max(0.0, cp_comm - 3 * attn)
        # EP: each MoE layer's dispatch and combine, forward, backward (and the recomputed
        # forward), exposed: the default schedule does not overlap them
        ep_one, ep_level = self._expert_comm(layout, place, tokens)
        return _LayerCost(
            gemm=gemm,
            attn=attn,
            mem_pass=mem_pass,
            share=share,
            experts=ex,
            fwd=fwd,
            bwd=bwd,
            recompute=recompute,
            tp_comm=tp_comm,
            tp_exp=tp_exp,
            cp_comm=cp_comm,
            cp_exp=cp_exp,
            ep_comm=passes * ep_one * share,
            ep_level=ep_level,
        )

    def _pipeline_p2p(
        self,
        layout: Layout,
        place,
        stage_t: float,
        per_step: int,
        exposed: list[float],
        hidden: list[float],
    ) -> tuple[float, float]:
        """(the worst and the mean exposed point-to-point time of one micro-batch's crossing of
        a stage boundary); adds the step's to ``exposed`` and ``hidden`` by level."""
        m, s, net = self.model, self.settings, self.net
        tp, pp, vp = layout.tp, layout.pp, layout.vp
        if pp == 1:
            return 0.0, 0.0
        tokens = layout.micro_batch * self.seq // layout.cp
        split = tp if (layout.sequence_parallel or s.p2p_scatter_gather) else 1
        act = tokens * m.hidden * s.param_bytes / split
        flows = place.pp_count
        times = []
        bounds = list(place.pp_boundaries)
        tiers = list(place.pp_tiers[:-1])
        if vp > 1:
            bounds.append(place.pp_wrap)
            tiers.append(place.pp_tiers[-1])
        for (level, link), tier in zip(bounds, tiers, strict=True):
            if link is not None:
                path = net.link_path(link, flows)
            else:
                path = net.level_path(level, tier)
            times.append((level, p2p(act, path)))
        # An activation forward and a gradient backward per microbatch and model chunk; in the
        # 1F1B steady state Megatron sends one while receiving the other in one batched call
        # (send_forward_recv_backward), opposite directions of a full-duplex link, so one
        # transfer time is exposed, not two (measured on shaped links: bench_sites.py).
        per_mb = vp
        chunk_compute = stage_t / vp / 2
        exp_list = []
        for level, t in times:
            e = max(0.0, t - chunk_compute) if s.overlap_p2p else t
            exp_list.append((level, per_mb * e, per_mb * t))
        p2p_max = max(exp_list, key=lambda x: x[1])[1]
        p2p_avg = sum(x[1] for x in exp_list) / len(exp_list)
        total_p2p = per_step * p2p_max + (pp - 1) / vp * p2p_avg
        lv = max(bounds, key=lambda x: x[0])[0]
        exposed[lv] += total_p2p
        all_p2p = (per_step + (pp - 1) / vp) * max(x[2] for x in exp_list)
        hidden[lv] += max(0.0, all_p2p - total_p2p)
        return p2p_max, p2p_avg

    def _gradient_sync(
        self,
        layout: Layout,
        place,
        stage_split: list[int],
        c: _LayerCost,
        exposed: list[float],
        hidden: list[float],
    ) -> tuple[float, float, float]:
        """(the exposed gradient reduction, the exposed parameter gather, the optimizer step),
        the dense weights' over the data-parallel group and the experts' over theirs; adds the
        traffic to ``exposed`` and ``hidden`` by level."""
        m, s, net = self.model, self.settings, self.net
        tp, cp, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
        hbm = self.gpu.hbm_bytes_s
        per_stage_layers = max(stage_split)
        ep, etp = layout.ep, layout.etp
        splits = [stage_param_split(m, tp, pp, i, n, ep, etp) for i, n in enumerate(stage_split)]
        params = max(d for d, _ in splits)
        expert_params = max(e for _, e in splits)
        grad_bytes = (4 if s.grad_reduce_in_fp32 else s.param_bytes) * params
        d = dp * cp
        buckets = max(1, _ceil_div(int(params), max(BUCKET_PARAMS, 1_000_000 * d)))
        grad_parts: list[tuple[int, float]] = []
        gather_parts: list[tuple[int, float]] = []
        if d > 1:
            per = grad_bytes / buckets
            k = layout.instances
            if not s.distributed_optimizer:
                path = net.path(place.dp)
                grad_parts.append((path.level, buckets * allreduce(d, per, path)))
            else:
                n_i = d // k
                if n_i > 1:
                    ipath = net.path(place.instance)
                    grad_parts.append((ipath.level, buckets * reduce_scatter(n_i, per, ipath)))
                    pbytes = params * s.param_bytes / buckets
                    gather_parts.append((ipath.level, buckets * all_gather(n_i, pbytes, ipath)))
                if k > 1:
                    cpath = net.path(place.cross)
                    grad_parts.append((cpath.level, buckets * allreduce(k, per / n_i, cpath)))
        # the backward of the last microbatch on the first stage (which finishes last)
        window = (c.bwd + c.recompute) * per_stage_layers if s.overlap_grad_reduce else 0.0
        grad_exp = _expose(grad_parts, window, exposed, hidden)
        window = c.fwd * per_stage_layers if s.overlap_param_gather else 0.0
        gather_exp = _expose(gather_parts, window, exposed, hidden)
        shard = d // layout.instances if s.distributed_optimizer else 1
        optimizer = params / shard * OPTIMIZER_BYTES_PER_PARAM / hbm
        if expert_params:
            # the routed experts' gradients over their own data-parallel group, after the rest
            edp = layout.edp
            e_shard = max(1, edp // layout.instances) if s.distributed_optimizer else 1
            optimizer += expert_params / e_shard * OPTIMIZER_BYTES_PER_PARAM / hbm
            if edp > 1:
                epath = net.path(place.edp)
                e_bytes = (4 if s.grad_reduce_in_fp32 else s.param_bytes) * expert_params
                if s.distributed_optimizer:
                    e_t = reduce_scatter(edp, e_bytes, epath)
                    e_t += all_gather(edp, expert_params * s.param_bytes, epath)
                else:
                    e_t = allreduce(edp, e_bytes, epath)
                grad_exp += _expose([(epath.level, e_t)], 0.0, exposed, hidden)
        return grad_exp, gather_exp, optimizer

    def experts(self, layout: Layout) -> ExpertCost | None:
        """What one MoE layer's routed experts cost on one GPU of ``layout`` per micro-batch
        (None for a dense model)."""
        m = self.model
        if not m.moe:
            return None
        key = (layout.micro_batch, layout.cp, layout.tp, layout.ep, layout.etp)
        if key not in self._experts:
            # sequence parallelism (required with TP for MoE) leaves each GPU 1/TP of the tokens
            local = layout.micro_batch * self.seq / layout.cp / layout.tp
            self._experts[key] = expert_layer_cost(
                m, local, layout.ep, layout.etp, self.gpu.peak_flops, self.gpu.hbm_bytes_s,
                self.eff, grouped=self.settings.grouped_gemm,
            )  # fmt: skip
        return self._experts[key]

    def _expert_comm(self, layout: Layout, place, tokens: int) -> tuple[float, int]:
        """(one MoE layer's all-to-all for one pass of one microbatch on one GPU, the level it
        crosses): dispatch and combine over the EP group, and with ETP > 1 the all-gather and
        reduce-scatter of the dispatched tokens over the expert tensor-parallel group."""
        m, s = self.model, self.settings
        if not m.moe or layout.ep * layout.etp == 1:
            return 0.0, 0
        net = self.net
        # sequence parallelism (required with TP for MoE) leaves each GPU 1/TP of the tokens
        local = tokens / layout.tp
        token_bytes = m.hidden * s.param_bytes
        t = 0.0
        level = 0
        if layout.ep > 1:
            g = place.ep
            nvlink, network, latency = net.all_to_all(g)
            if s.dispatcher == "flex":
                spread = routing_spread(
                    m.experts, m.top_k, layout.ep, g.members_per_node, m.groups, m.group_limit
                )
                one = deduplicated_time(local, token_bytes, spread, nvlink, network, latency)
            else:
                one = per_copy_time(
                    local,
                    m.top_k,
                    token_bytes,
                    layout.ep,
                    g.members_per_node,
                    nvlink,
                    network,
                    latency,
                )
            t += 2 * one  # dispatch and combine
            level = g.level
        if layout.etp > 1:
            path = net.path(place.etp)
            gathered = local * m.top_k * layout.etp * token_bytes
            t += 2 * all_gather(layout.etp, gathered, path)
            level = max(level, path.level)
        return t, level

    def placements_computed(self) -> int:
        """Rank placements worked out so far, over every order of the sites."""
        topologies = [self.topology, *self._topologies.values()]
        return sum(t.computed for t in topologies)

    def with_cluster(self, cluster: Cluster) -> Evaluator:
        """The same model, batch, settings and constants on another cluster."""
        return Evaluator(self.model, cluster, self.seq, self.global_batch, self.settings, self.eff)

    def with_settings(self, **changes: object) -> Evaluator:
        """The same problem under changed settings."""
        return Evaluator(
            self.model,
            self.cluster,
            self.seq,
            self.global_batch,
            replace(self.settings, **changes),
            self.eff,
        )


def _expose(
    parts: list[tuple[int, float]], window: float, exposed: list[float], hidden: list[float]
) -> float:
    """Time of sequential collectives not hidden by ``window``; split over levels pro rata."""
    total = sum(t for _, t in parts)
    if total <= 0:
        return 0.0
    out = max(0.0, total - window)
    for level, t in parts:
        exposed[level] += out * t / total
        hidden[level] += (total - out) * t / total
    return out
