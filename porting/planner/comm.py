"""Alpha-beta costs of NCCL collectives, and the bandwidth a group sees at each level.

A collective over ``n`` ranks moving ``size`` bytes per rank costs ``steps x alpha + bytes / bw``
(Hockney's model; ring and tree forms as in Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005, and NCCL's ``doc/PERFORMANCE.md``):

- ring all-reduce: ``2(n-1) alpha + 2 (n-1)/n size / bw``
- tree all-reduce (NCCL's double binary tree): ``2 ceil(log2 n) alpha + 2 size / bw``
- ring reduce-scatter / all-gather: ``(n-1) alpha + (n-1)/n size / bw`` (``size`` = full buffer)
- point-to-point: ``alpha + size / bw``

``bw`` is the bus bandwidth one rank gets: NVLink inside a node; ``members per node x NIC``
between nodes (a ring crosses each node boundary once, and the node's NICs carry all the rings
that cross it); over an inter-site link, the link's usable bandwidth shared by the groups that
cross it at once, and at most ``channels x NCCL_BUFFSIZE / RTT`` per group: NCCL keeps one
buffer (``NCCL_STEPS`` = 8 slots) in flight per channel and connection, so a channel cannot move
more than one buffer per round trip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from porting.planner.cluster import MIB, Cluster, Link, NcclSettings
from porting.planner.limits import Range
from porting.planner.placement import NODE, SITE, WAN, GroupShape

# NCCL_BUFFSIZE values the planner recommends stay within these bounds: NCCL's default, and a
# ceiling past which the buffers' GPU memory (channels x peers x buffer) starts to matter.
MIN_BUFFSIZE = 4 * MIB
MAX_BUFFSIZE = 64 * MIB
MAX_STREAMS = 8


@dataclass(frozen=True)
class Efficiency:
    """The fitted constants: fractions of nominal speed reached in practice.

    ``compute`` is the fraction of dense bf16 peak that the GEMMs reach; ``memory_passes`` is
    how many times the memory-bound kernels (norms, activations, dropout, softmax, residuals)
    read or write each activation byte that a layer stores (Korthikanti et al. 2022's count),
    over forward and backward. Defaults: fitted to Narayanan et al. Table 1 rows 1.7B and 145B
    (A100, see tests/test_plan_published.py); the bandwidth fractions are typical nccl-tests
    bus bandwidths over nominal. ``porting plan --calibrate`` refits them from measurements.
    """

    compute: float = 0.674
    memory_passes: float = 7.18
    node_bw: float = 0.80
    site_bw: float = 0.85
    wan_rdma: float = 0.90
    wan_tcp: float = 0.60
    node_latency: float | None = None  # seconds per step; None: the cluster file's value
    site_latency: float | None = None
    wan_latency_scale: float = 1.0
    # The expert-parallel all-to-all (porting/planner/alltoall.py): NVLink fraction its kernels
    # reach and the fixed cost of one dispatch or combine, fitted to DeepEP's EP 8 rows (normal
    # dispatch 153 of 160 GB/s; low-latency dispatch 77 us and combine 114 us); between nodes it
    # uses ``site_bw``, not fitted to DeepEP.
    a2a_node_bw: float = 0.96
    a2a_latency: float = 22e-6
    # the all-to-all's share of the level's collective bandwidth between nodes of a site and
    # over an inter-site link (1: as rings reach); ``--calibrate`` fits them and ``a2a_latency``
    # from alltoall logs
    a2a_net_bw: float = 1.0
    a2a_wan_bw: float = 1.0
    # The expert GEMMs by their shape (porting/planner/experts.py): the fraction of peak they
    # reach when compute-bound, of HBM bandwidth when their weights bound them, the kernel's row
    # tile, and the launch a looped (not grouped) expert pays; ``--calibrate`` fits them from a
    # grouped-GEMM benchmark log
    expert_compute: float = 0.80
    expert_hbm: float = 0.61
    expert_tile: int = 64
    expert_launch: float = 30e-6


# What each constant may be, from a constants file or a fit (docs/planner.md "Limits"): a
# fraction of peak above 1, a bandwidth ten times its nominal or a latency of seconds per step is
# a wrong log or cluster file, and zero would divide.
EFFICIENCY_RANGES = {
    "compute": Range(0.001, 1),
    "memory_passes": Range(0.001, 1000),
    "node_bw": Range(0.001, 10),
    "site_bw": Range(0.001, 10),
    "wan_rdma": Range(0.001, 10),
    "wan_tcp": Range(0.001, 10),
    "node_latency": Range(1e-9, 1),
    "site_latency": Range(1e-9, 1),
    "wan_latency_scale": Range(0, 1000),
    "a2a_node_bw": Range(0.001, 10),
    "a2a_latency": Range(0, 1),
    "a2a_net_bw": Range(0.001, 10),
    "a2a_wan_bw": Range(0.001, 10),
    "expert_compute": Range(0.001, 1),
    "expert_hbm": Range(0.001, 1),
    "expert_tile": Range(1, 1024, integer=True),
    "expert_launch": Range(0, 0.01),
}


def check_efficiency(eff: Efficiency, where: str) -> Efficiency:
    """``eff`` if every constant is inside its range; else an error naming ``where`` and it."""
    for name, accepted in EFFICIENCY_RANGES.items():
        value = getattr(eff, name)
        if value is not None:
            accepted.check(value, f"{where}: {name}")
    return eff


@dataclass(frozen=True)
class Path:
    """What one rank of a group sees: bytes/s, seconds per step, and the widest level."""

    bandwidth: float
    latency: float
    level: int


def ring_allreduce(n: int, size: float, p: Path) -> float:
    """Ring all-reduce time."""
    if n <= 1 or size <= 0:
        return 0.0
    return 2 * (n - 1) * p.latency + 2 * (n - 1) / n * size / p.bandwidth


def tree_allreduce(n: int, size: float, p: Path) -> float:
    """Double-binary-tree all-reduce time (log latency, full-buffer bandwidth term)."""
    if n <= 1 or size <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * p.latency + 2 * size / p.bandwidth


def allreduce(n: int, size: float, p: Path) -> float:
    """NCCL picks the faster of ring and tree for each message size."""
    return min(ring_allreduce(n, size, p), tree_allreduce(n, size, p))


def reduce_scatter(n: int, size: float, p: Path) -> float:
    """Ring reduce-scatter of a ``size``-byte buffer (all-gather costs the same)."""
    if n <= 1 or size <= 0:
        return 0.0
    return (n - 1) * p.latency + (n - 1) / n * size / p.bandwidth


all_gather = reduce_scatter


def p2p(size: float, p: Path) -> float:
    """One point-to-point transfer."""
    if size <= 0:
        return 0.0
    return p.latency + size / p.bandwidth


def tuned_streams(base: NcclSettings, link: Link) -> int:
    """Queue pairs (or sockets) per connection: enough for one flow to use every parallel link."""
    return min(MAX_STREAMS, max(base.streams, link.count))


def tuned_nccl(base: NcclSettings, share: float, link: Link) -> NcclSettings:
    """NCCL settings for flows of ``share`` bytes/s over ``link``.

    The buffer is the bandwidth-delay product per channel (``share x RTT / channels``), rounded
    up to a power of two within [4, 64] MiB; queue pairs (or sockets for TCP) are raised until
    the flows crossing can hash onto every parallel link.
    """
    need = share * link.rtt / base.channels
    buff = MIN_BUFFSIZE
    while buff < need and buff < MAX_BUFFSIZE:
        buff *= 2
    streams = tuned_streams(base, link)
    if link.transport == "tcp":
        threads = min(MAX_STREAMS, max(base.socket_threads, math.ceil(streams / 2)))
        return NcclSettings(
            buffsize=max(buff, base.buffsize),
            channels=base.channels,
            qps_per_connection=base.qps_per_connection,
            socket_threads=threads,
            socks_per_thread=max(base.socks_per_thread, 2 if streams > 1 else 1),
        )
    return NcclSettings(
        buffsize=max(buff, base.buffsize),
        channels=base.channels,
        qps_per_connection=max(base.qps_per_connection, streams),
        socket_threads=base.socket_threads,
        socks_per_thread=base.socks_per_thread,
    )


class Network:
    """Bandwidth and latency per level for one cluster under one set of efficiency constants."""

    def __init__(self, cluster: Cluster, eff: Efficiency, tune: bool = True):
        self.cluster = cluster
        self.eff = eff
        self.tune = tune
        sites = cluster.sites
        self.node_bw = min(s.node.bandwidth for s in sites)
        self.net_bw = min(s.net.bandwidth for s in sites)
        self.node_lat = (
            eff.node_latency if eff.node_latency is not None else max(s.node.latency for s in sites)
        )
        self.site_lat = (
            eff.site_latency if eff.site_latency is not None else max(s.net.latency for s in sites)
        )
        # racks/zones inside the sites: tier t is a group spanning domains of level t - 1, which
        # sees the worst oversubscription of the uplinks up to that level and its latency
        depth = max((len(x.domains) for x in sites), default=0)
        self.tier_oversubscription = [1.0]
        self.tier_latency = [self.site_lat]
        for t in range(1, depth + 1):
            over = lat = 0.0
            for x in sites:
                inside = x.domains[:t]
                over = max(over, max((d.oversubscription for d in inside), default=1.0))
                left = x.domains[t - 1].latency if t <= len(x.domains) else None
                lat = max(lat, self.site_lat if left is None else left)
            self.tier_oversubscription.append(over)
            self.tier_latency.append(lat)
        # every layout of a placement asks for the same few paths: the search's hot spot
        self._paths: dict[tuple, tuple[object, Path]] = {}

    def link_share(self, link: Link, flows: int) -> tuple[float, NcclSettings]:
        """Bandwidth one of ``flows`` concurrent flows gets over ``link``, and the NCCL settings.

        Each flow hashes onto one of the parallel links per stream (queue pair or socket), so
        ``count`` links are only all in use once ``flows x streams >= count``. With tuning, the
        streams are raised first and the buffer is then sized for the resulting share, so the
        result is ``min(share, channels x buffer ceiling / RTT)``: never lower for more
        bandwidth, never higher for a longer RTT.
        """
        flows = max(1, flows)
        eff = self.eff.wan_tcp if link.transport == "tcp" else self.eff.wan_rdma
        base = self.cluster.nccl
        streams = tuned_streams(base, link) if self.tune else base.streams
        usable = link.bandwidth * min(link.count, flows * streams) * eff
        share = min(usable / flows, self.net_bw * self.eff.site_bw)
        nccl = tuned_nccl(base, share, link) if self.tune else base
        if link.rtt <= 0:  # no distance and no switch latency: nothing in flight to wait for
            return share, nccl
        window = nccl.channels * nccl.buffsize / link.rtt
        return min(share, window), nccl

    def path(self, g: GroupShape, flows: int | None = None) -> Path:
        """The path a ring over groups shaped ``g`` sees (``flows``: groups crossing at once)."""
        # by identity (hashing a shape hashes all its links); the entry keeps ``g`` alive, so
        # its id cannot come back for another shape
        key = (id(g), flows)
        hit = self._paths.get(key)
        if hit is None:
            hit = self._paths[key] = (g, self._path(g, flows))
        return hit[1]

    def _path(self, g: GroupShape, flows: int | None) -> Path:
        node = self.node_bw * self.eff.node_bw
        if g.level == NODE:
            return Path(node, self.node_lat, NODE)
        site = min(self.node_bw, g.members_per_node * self.net_bw) * self.eff.site_bw
        site /= self.tier_oversubscription[g.tier]
        if g.level == SITE:
            return Path(min(node, site), self.tier_latency[g.tier], SITE)
        bw, lat = min(node, site), self.tier_latency[g.tier]
        for link in g.links:
            share, _ = self.link_share(link, flows if flows is not None else g.count)
            bw = min(bw, share)
            lat = max(lat, link.one_way * self.eff.wan_latency_scale + self.site_lat)
        return Path(bw, lat, WAN)

    def where(self, level: int, tier: int = 0) -> str:
        """Where a group of ``level`` spanning ``tier`` levels of the sites' domains sits, in the
        cluster's own words ("across racks of a zone (1:7 oversubscribed)")."""
        if level == NODE:
            return "inside a node"
        if level == WAN:
            return "across sites"
        # the site with the most levels names them (sites that list fewer are one domain above)
        deepest = max(self.cluster.sites, key=lambda x: len(x.domains))
        names = ["node", *(d.name for d in deepest.domains)]
        tier = min(tier, len(names) - 1)
        text = f"across {names[tier]}s" + (
            f" of a {names[tier + 1]}" if tier + 1 < len(names) else ""
        )
        over = self.tier_oversubscription[tier]
        return text + (f" (1:{over:g} oversubscribed)" if over > 1 else "")

    def all_to_all(self, g: GroupShape) -> tuple[float, float, float]:
        """(bytes/s to the GPUs of its own node, bytes/s to other nodes, fixed seconds) one GPU
        of an all-to-all over groups shaped ``g`` sees: NVLink at ``a2a_node_bw``; its own NIC
        (the all-to-all spreads over every node, it is not a ring) through the oversubscribed
        uplinks of the domains the group leaves; across sites, the link shared by the members
        that send over it at once (half of every group's)."""
        nvlink = self.node_bw * self.eff.a2a_node_bw
        network = self.net_bw * self.eff.site_bw / self.tier_oversubscription[g.tier]
        network *= self.eff.a2a_net_bw
        latency = self.eff.a2a_latency
        if g.level == WAN:
            flows = max(1, g.count * g.size // 2)
            for link in g.links:
                network = min(network, self.link_share(link, flows)[0] * self.eff.a2a_wan_bw)
                latency = max(
                    latency, self.eff.a2a_latency + link.one_way * self.eff.wan_latency_scale
                )
        return nvlink, network, latency

    def link_path(self, link: Link, flows: int) -> Path:
        """A point-to-point path over one inter-site link with ``flows`` concurrent flows."""
        key = (id(link), flows)
        hit = self._paths.get(key)
        if hit is None:
            hit = self._paths[key] = (link, self._link_path(link, flows))
        return hit[1]

    def _link_path(self, link: Link, flows: int) -> Path:
        share, _ = self.link_share(link, flows)
        bw = min(share, self.net_bw * self.eff.site_bw)
        return Path(bw, link.one_way * self.eff.wan_latency_scale + self.site_lat, WAN)

    def level_path(self, level: int, tier: int = 0) -> Path:
        """A point-to-point path inside a node or between nodes of a site (``tier``: the levels
        of the site's domains it leaves)."""
        if level == NODE:
            return Path(self.node_bw * self.eff.node_bw, self.node_lat, NODE)
        bw = self.net_bw * self.eff.site_bw / self.tier_oversubscription[tier]
        return Path(bw, self.tier_latency[tier], SITE)
