"""What an MoE layer's experts cost on one GPU, besides the all-to-all: the expert GEMMs by their
shape, and the router, permutation and unpermutation.

An expert GEMM is a roofline: ``2 M K N`` FLOPs at ``expert_compute`` of peak against the bytes
it must move (the expert's weights, its input and output rows) at ``expert_hbm`` of HBM bandwidth,
combined as ``sqrt(compute^2 + memory^2)`` so the knee is smooth, with ``M`` rounded up to the
kernel's row tile. ``M`` is the tokens each expert gets per micro-batch: a GPU's tokens (1/TP of
the micro-batch's 1/CP under sequence parallelism), times the EP x ETP ranks that share the
experts, times top-k, over the experts. So an expert that sees 32 rows reads its whole weight
matrix for 32 rows of work: at 2 bytes a weight that is 32 FLOPs a byte, about a tenth of an
H100's 295 FLOPs a byte, and the GEMM runs near a tenth of its dense rate. EP raises ``M`` by
gathering more tokens onto fewer experts; that is what it buys besides memory.

Every expert GEMM also pays ``expert_launch``, a fixed cost per expert per GEMM: on Hopper,
Transformer Engine's grouped GEMM is cuBLAS called once per expert (on a few streams), after
the alltoall dispatcher's host synchronisation on the token counts, so the launches are exposed;
it is what makes 16 local experts slower than 4 at the same FLOPs. ``--no-grouped-gemm``
(Megatron's SequentialMLP) runs the experts strictly one after another, each GEMM filling at
most its own tiles' share of the SMs.

The router (a GEMM counted with the dense weights, then fp32 softmax and top-k over the experts)
and the permutation and unpermutation (each token's row copied to its top-k slots and back,
weighted) are memory-bound: their bytes at ``expert_hbm`` of HBM bandwidth, forward and again
backward.

Constants (``porting.planner.comm.Efficiency``; ``--calibrate`` refits them from a grouped-GEMM
benchmark log, docs/planner.md): ``expert_hbm`` 0.61 and ``expert_tile`` 64 are fitted to the
28 rows of DeepGEMM's published tables (deepseek-ai/DeepGEMM README at 327ec92, H800, FP8: dense
M = 64, 128, 4096, grouped 256-8192 rows per group), within 30% of each, 16% root mean square;
``expert_compute`` 0.80 to Megatron-LM's H100 MoE-layer baseline (moe_perf/baseline.json, the
Mixtral proxy's forward and backward, BF16), its DeepSeek proxy held out; ``expert_launch``
30 us is the one constant fitted to published training runs (the value, in 2 us steps, with the
smallest worst error over the runs of tests/test_plan_experts.py and MoE Parallel Folding's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Hopper has 132 SMs; a single expert GEMM's tiles fill at most that many
SMS = 132
# the column tile a GEMM kernel's output is cut into with its row tile (``expert_tile``)
TILE_N = 128
# bytes the weight-gradient GEMM moves per weight: it accumulates into the fp32 main gradient
# (Megatron's gradient-accumulation fusion): a read and a write of 4 bytes
WGRAD_BYTES = 8


@dataclass(frozen=True)
class ExpertCost:
    """One MoE layer's experts for one micro-batch on one GPU (seconds), and their shape."""

    tokens_per_expert: float
    local_experts: int
    forward: float  # the expert GEMMs
    backward: float  # their data and weight gradients
    routing_forward: float  # router softmax/top-k, permutation and unpermutation
    routing_backward: float


def tokens_per_expert(local_tokens: float, top_k: int, experts: int, ep: int, etp: int) -> float:
    """Rows each expert's GEMM gets per micro-batch under balanced routing."""
    return local_tokens * ep * etp * top_k / experts


def gemm_seconds(
    rows: float,
    k: int,
    n: int,
    groups: int,
    peak: float,
    hbm: float,
    eff,
    *,
    element_bytes: float = 2,
    grouped: bool = True,
) -> float:
    """``groups`` GEMMs of ``rows`` x ``k`` times ``k`` x ``n`` (forward or data gradient)."""
    if rows <= 0:
        return 0.0
    tile = eff.expert_tile
    padded = math.ceil(rows / tile) * tile
    tiles = math.ceil(rows / tile) * math.ceil(n / TILE_N)
    flops = 2 * padded * k * n
    moved = element_bytes * (k * n + rows * k) + 2 * rows * n
    if grouped:
        compute = groups * flops / (peak * eff.expert_compute)
        memory = groups * moved / (hbm * eff.expert_hbm)
        return math.hypot(compute, memory) + groups * eff.expert_launch
    # one launch per expert, each filling at most its own tiles' share of the SMs
    fill = min(1.0, tiles / SMS)
    one = math.hypot(flops / (peak * eff.expert_compute), moved / (hbm * eff.expert_hbm))
    return groups * (one / fill + eff.expert_launch)


def wgrad_seconds(
    rows: float, k: int, n: int, groups: int, peak: float, hbm: float, eff, *, grouped: bool = True
) -> float:
    """The weight gradients of ``groups`` experts' ``k`` x ``n`` weights over ``rows`` tokens:
    the rows are the reduction, so only the weight's tiles quantize."""
    if rows <= 0:
        return 0.0
    flops = 2 * rows * k * n
    moved = 2 * rows * (k + n) + WGRAD_BYTES * k * n
    compute = flops / (peak * eff.expert_compute)
    memory = moved / (hbm * eff.expert_hbm)
    if grouped:
        return groups * (math.hypot(compute, memory) + eff.expert_launch)
    tiles = math.ceil(k / eff.expert_tile) * math.ceil(n / TILE_N)
    fill = min(1.0, tiles / SMS)
    return groups * (math.hypot(compute, memory) / fill + eff.expert_launch)


def expert_layer_cost(
    m, local_tokens: float, ep: int, etp: int, peak: float, hbm: float, eff, grouped: bool = True
) -> ExpertCost:
    """The routed experts of one MoE layer of ``m`` on one GPU of an EP x ETP group, for one
    micro-batch whose share on this GPU is ``local_tokens``."""
    rows = tokens_per_expert(local_tokens, m.top_k, m.experts, ep, etp)
    local = m.experts // ep
    width = m.moe_ffn // etp
    up = (2 if m.gated else 1) * width
    h = m.hidden
    kw = {"grouped": grouped}
    fwd = gemm_seconds(rows, h, up, local, peak, hbm, eff, **kw)
    fwd += gemm_seconds(rows, width, h, local, peak, hbm, eff, **kw)
    # data gradients: the same shapes transposed (each reads its weight again)
    bwd = gemm_seconds(rows, up, h, local, peak, hbm, eff, **kw)
    bwd += gemm_seconds(rows, h, width, local, peak, hbm, eff, **kw)
    bwd += wgrad_seconds(rows, h, up, local, peak, hbm, eff, **kw)
    bwd += wgrad_seconds(rows, width, h, local, peak, hbm, eff, **kw)
    # the router's fp32 scores (written, then read by softmax and top-k), the permutation (each
    # token read, its top-k copies written) and the unpermutation (the copies read, the weighted
    # sum written), 2-byte rows; the backward moves the same again
    token = 2 * h
    routed = local_tokens * (4 * 3 * m.experts + 2 * token * (1 + m.top_k))
    routing = routed / (hbm * eff.expert_hbm)
    return ExpertCost(
        tokens_per_expert=rows,
        local_experts=local,
        forward=fwd,
        backward=bwd,
        routing_forward=routing,
        routing_backward=routing,
    )
