"""The expert-parallel all-to-all: what an MoE layer's dispatch and combine move, and how long.

An MoE layer sends each token to the GPUs holding its top-k experts (dispatch) and brings the
expert outputs back (combine); backward does both again. Two ways of moving them are modelled:

- **per copy** (Megatron-Core's ``alltoall`` token dispatcher, and DeepEP's low-latency kernels):
  one copy of a token per routed expert. The copies for GPUs of the same node go over NVLink, the
  rest over the GPU's NIC, both at once: ``latency + max(local / NVLink, remote / NIC)``.
- **deduplicated** (DeepEP's normal kernels, Megatron's ``flex`` dispatcher): a token crosses the
  network once per destination *node* (RDMA), then is forwarded inside that node over NVLink to
  each GPU holding one of its experts: ``latency + max(T x GPUs per token x bytes / NVLink,
  T x remote nodes per token x bytes / NIC)``. Node-limited routing (DeepSeek-V3: a token's
  experts from at most ``topk_group`` of ``n_group`` groups, i.e. at most 4 nodes) bounds the
  second term.

How many GPUs and nodes a token reaches is the expectation under uniform routing over the
allowed experts (hypergeometric: a unit holding ``a`` of the ``A`` allowed experts is missed by
all ``k`` picks with probability ``C(A - a, k) / C(A, k)``), the routing DeepEP's own benchmark
draws (``tests/legacy/test_internode.py``: random scores, top ``min(nodes, 4)`` node groups).
Checked against DeepEP's published tables in ``tests/test_plan_moe.py`` (docs/planner.md,
"Mixture of experts").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Spread:
    """Where one token's experts sit, expected over uniform routing."""

    gpus: float  # distinct GPUs of the EP group holding at least one of its experts
    nodes: float  # distinct nodes
    remote_nodes: float  # distinct nodes other than the sending GPU's


def _missed(allowed: int, held: float, k: int) -> float:
    """Probability that ``k`` distinct picks from ``allowed`` experts miss ``held`` of them."""
    rest = allowed - held
    if rest < k:
        return 0.0
    # C(rest, k) / C(allowed, k) in logarithms: exact binomials of 65,536 experts are huge ints
    return math.exp(
        math.lgamma(rest + 1)
        - math.lgamma(rest - k + 1)
        - math.lgamma(allowed + 1)
        + math.lgamma(allowed - k + 1)
    )


def _hit(units: int, experts: int, top_k: int, groups: int, group_limit: int) -> float:
    """Probability that a given one of ``units`` equal blocks of the experts (GPUs or nodes, in
    expert order) holds at least one of a token's ``top_k`` experts."""
    held = experts / units
    if units == 1:
        return 1.0  # one unit holds every expert
    if not groups or group_limit >= groups:
        return 1.0 - _missed(experts, held, top_k)
    per_group = experts // groups
    allowed = group_limit * per_group
    if units % groups == 0:
        # a unit inside one group: hit only where its group is one of the token's groups
        return group_limit / groups * (1.0 - _missed(allowed, held, top_k))
    if groups % units == 0:
        # a unit of c whole groups: j of them chosen (hypergeometric), j x per_group allowed
        c = groups // units
        p = 0.0
        for j in range(max(1, group_limit - (groups - c)), min(c, group_limit) + 1):
            # hypergeometric: j of the unit's c groups among the token's group_limit
            ways = math.exp(
                _log_comb(c, j)
                + _log_comb(groups - c, group_limit - j)
                - _log_comb(groups, group_limit)
            )
            p += ways * (1.0 - _missed(allowed, j * per_group, top_k))
        return p
    # groups and units that do not nest: the limit is left out (more spread, never less)
    return 1.0 - _missed(experts, held, top_k)


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


@lru_cache(maxsize=4096)
def routing_spread(
    experts: int, top_k: int, ep: int, per_node: int, groups: int = 0, group_limit: int = 0
) -> Spread:
    """Expected GPUs and nodes a token's experts sit on, for experts laid out in order over an
    EP group of ``ep`` GPUs with ``per_node`` of them on each node."""
    per_node = max(1, min(per_node, ep))
    nodes = max(1, ep // per_node)
    gpu = _hit(ep, experts, top_k, groups, group_limit)
    node = _hit(nodes, experts, top_k, groups, group_limit)
    return Spread(gpus=ep * gpu, nodes=nodes * node, remote_nodes=(nodes - 1) * node)


def per_copy_time(
    tokens: float,
    top_k: int,
    token_bytes: float,
    ep: int,
    per_node: int,
    nvlink: float,
    network: float,
    latency: float,
) -> float:
    """One dispatch or combine sending a copy per routed expert (seconds): the copies for this
    node's ``per_node`` GPUs over NVLink (``nvlink`` bytes/s), the others over the NIC."""
    if ep <= 1 or tokens <= 0:
        return 0.0
    total = tokens * top_k * token_bytes
    local = total * min(per_node, ep) / ep
    remote = total - local
    return latency + max(local / nvlink, remote / network if remote else 0.0)


def deduplicated_time(
    tokens: float, token_bytes: float, spread: Spread, nvlink: float, network: float, latency: float
) -> float:
    """One dispatch or combine sending a token once per node, forwarded inside it (seconds)."""
    if tokens <= 0 or spread.gpus <= 1 and spread.remote_nodes == 0:
        return 0.0
    nvl = tokens * spread.gpus * token_bytes / nvlink
    rdma = tokens * spread.remote_nodes * token_bytes / network if spread.remote_nodes else 0.0
    return latency + max(nvl, rdma)
