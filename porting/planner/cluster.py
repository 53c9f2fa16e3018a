"""Cluster descriptions: sites, the bandwidth levels inside them and the links between them.

A cluster file (YAML) names every quantity with its unit::

    name: two-sites
    gpu: {name: H100-SXM, peak_bf16_tflops: 989, memory_gib: 80, hbm_tbytes_s: 3.35}
    node: {bandwidth_gbytes_s: 450, latency_us: 3}     # NVLink, per GPU, one direction
    site: {bandwidth_gbit_s: 400, latency_us: 5}       # IB/RoCE NIC per GPU
    sites:
      - {name: a, nodes: 16, gpus_per_node: 8}
      - {name: b, nodes: 16, gpus_per_node: 8}
    links:
      - {sites: [a, b], bandwidth_gbit_s: 400, count: 2, distance_km: 30, transport: rdma}

``gpu``, ``node`` and ``site`` may be given per site instead of (or to override) the top level.
Inside a site, ``site.domains`` may describe racks (or NVLink domains of several nodes), zones and
buildings, innermost first, each with the nodes it holds, the oversubscription of the uplinks that
traffic leaving it crosses (default 1) and the one-way latency of a path that leaves it::

    site:
      bandwidth_gbit_s: 400
      latency_us: 5
      domains:
        - {name: rack, nodes: 2, latency_us: 7}
        - {name: zone, nodes: 384, oversubscription: 7, latency_us: 7}

Each domain's nodes are a multiple of the one inside it and divide the site's nodes; a domain's
latency is no lower than the one inside it (the site's between nodes for the first).
A link gives ``distance_km`` (fibre: about 5 microseconds per km one way) or a measured
``rtt_ms``. Every error names the file and the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from porting.errors import PortingError
from porting.planner.limits import (
    MAX_CLUSTER_BYTES,
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_LINK_COUNT,
    MAX_ORDER_STEPS,
    MAX_SITE_ORDERS,
    MAX_SITES,
    Range,
    parse_yaml,
    positive_int,
    read_text,
    show,
)

# Light in fibre travels at about c/1.47, i.e. ~4.9 us per km one way; 5 us/km is the usual
# planning figure (and what the DESIGN notes measured across sites).
FIBRE_US_PER_KM = 5.0
MIB = 1 << 20
GIB = 1 << 30

# What each field accepts (docs/planner.md "Limits"): floors keep every time finite, ceilings are
# far above any real hardware (a B200 is ~2.3 PFLOP/s dense bf16 with 192 GB at 8 TB/s, NVLink 5
# 900 GB/s a direction, NICs 800 Gb/s), so a value past one is a typo or a hostile file.
TFLOPS = Range(0.001, 100_000)
MEMORY_GIB = Range(0.001, 65_536)
HBM_TBYTES_S = Range(0.001, 1_000)
NODE_GBYTES_S = Range(0.001, 100_000)
NET_GBIT_S = Range(0.001, 1_000_000)  # a site's NIC per GPU, and one inter-site link
LATENCY_US = Range(0, 1_000_000)
RTT_MS = Range(1e-6, 10_000)  # a geostationary satellite hop is ~600 ms
DISTANCE_KM = Range(0, 50_000)  # longer than any fibre path on Earth
BUFFSIZE_MIB = Range(0.001, 1024)
# NCCL's own ceilings: MAXCHANNELS 64, NCCL_IB_QPS_PER_CONNECTION 128, socket threads 16 and
# sockets per thread 16 (net_socket.cc)
CHANNELS = positive_int(64)
QPS = positive_int(128)
SOCKETS = positive_int(16)
# Site names become host names, file names and shell variables in the emitted scripts; the other
# names land in comments and a Python docstring of them.
SITE_NAME = (
    re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}"),
    "a letter, then letters, digits, '_' or '-', 64 at most",
)
MAX_DOMAINS = 8
OVERSUBSCRIPTION = Range(1, 1000)
LABEL = (
    re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._+()/-]{0,127}"),
    "letters, digits and ' ._+()/-', 128 at most",
)


@dataclass(frozen=True)
class GPU:
    """One accelerator: dense bf16 peak, memory capacity and HBM bandwidth."""

    name: str
    peak_flops: float
    memory_bytes: float
    hbm_bytes_s: float


@dataclass(frozen=True)
class Level:
    """A bandwidth level as one GPU sees it: bytes/s in one direction and one-way latency."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Domain:
    """A group of consecutive nodes inside a site (a rack, a zone, a building)."""

    name: str
    nodes: int
    oversubscription: float  # of the uplinks that traffic leaving the domain crosses
    latency: float | None  # one way, for a path that leaves it (seconds); None: the site's


@dataclass(frozen=True)
class Site:
    """A data centre (or a partition of one): identical nodes on one fabric."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPU
    node: Level  # inside a node (NVLink/NVSwitch)
    net: Level  # between nodes of this site (per-GPU NIC)
    domains: tuple[Domain, ...] = ()  # innermost first

    @property
    def gpus(self) -> int:
        """GPUs in the site."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Link:
    """``count`` parallel links between two sites, each ``bandwidth`` bytes/s per direction."""

    a: str
    b: str
    bandwidth: float
    count: int
    rtt: float  # seconds
    transport: str  # "rdma" or "tcp"
    distance_km: float | None = None

    @property
    def one_way(self) -> float:
        """One-way latency in seconds."""
        return self.rtt / 2


@dataclass(frozen=True)
class NcclSettings:
    """NCCL settings that bound throughput over long links (defaults are NCCL's own)."""

    buffsize: int = 4 * MIB  # NCCL_BUFFSIZE: the in-flight window of one channel
    channels: int = 2  # channels one connection spreads over (NCCL_MIN_NCHANNELS)
    qps_per_connection: int = 1  # NCCL_IB_QPS_PER_CONNECTION
    socket_threads: int = 1  # NCCL_SOCKET_NTHREADS (TCP)
    socks_per_thread: int = 1  # NCCL_NSOCKS_PERTHREAD (TCP)

    @property
    def streams(self) -> int:
        """Parallel flows one connection opens (queue pairs, or sockets for TCP)."""
        return max(self.qps_per_connection, self.socket_threads * self.socks_per_thread)


@dataclass(frozen=True)
class Cluster:
    """Sites in rank order (ranks are assigned site by site, node by node) and their links."""

    name: str
    sites: tuple[Site, ...]
    links: tuple[Link, ...] = ()
    nccl: NcclSettings = field(default_factory=NcclSettings)

    @property
    def world(self) -> int:
        """Total number of GPUs."""
        return sum(s.gpus for s in self.sites)

    @property
    def nodes(self) -> int:
        """Total number of nodes."""
        return sum(s.nodes for s in self.sites)

    @cached_property
    def _by_pair(self) -> dict[frozenset[str], Link]:
        return {frozenset((ln.a, ln.b)): ln for ln in self.links}

    def link(self, a: str, b: str) -> Link:
        """The link between sites ``a`` and ``b`` (either order)."""
        found = self._by_pair.get(frozenset((a, b)))
        if found is None:
            raise PortingError(f"links: no link between sites {a!r} and {b!r}")
        return found

    def linked(self, a: str, b: str) -> bool:
        """Whether sites ``a`` and ``b`` are joined by a link."""
        return frozenset((a, b)) in self._by_pair

    def ring_links(self) -> list[Link]:
        """Links a ring over the sites in file order uses (with the wrap-around for 3+ sites)."""
        names = [s.name for s in self.sites]
        if len(names) < 2:
            return []
        pairs = list(zip(names, names[1:], strict=False))
        if len(names) > 2:
            pairs.append((names[-1], names[0]))
        return [self.link(a, b) for a, b in pairs]

    def slowest_gpu(self) -> GPU:
        """Synchronous training runs at the pace of the weakest GPU and fits its memory."""
        gpus = [s.gpu for s in self.sites]
        return GPU(
            name=min(gpus, key=lambda g: g.peak_flops).name,
            peak_flops=min(g.peak_flops for g in gpus),
            memory_bytes=min(g.memory_bytes for g in gpus),
            hbm_bytes_s=min(g.hbm_bytes_s for g in gpus),
        )

    def one_site(self) -> Cluster:
        """The same GPUs as one site (for the slowdown column): first site's levels, no links."""
        first = self.sites[0]
        gpn = first.gpus_per_node
        if self.world % gpn:
            # sites of different node sizes: nodes that every site's node size is made of
            gpn = math.gcd(*(s.gpus_per_node for s in self.sites))
        # no racks or zones: the reference is the same GPUs on one flat fabric, whatever the
        # order of the sites in the file
        merged = replace(
            first, name="one-site", nodes=self.world // gpn, gpus_per_node=gpn, domains=()
        )
        return Cluster(name=f"{self.name} (one site)", sites=(merged,), nccl=self.nccl)

    def reordered(self, names: tuple[str, ...]) -> Cluster:
        """The same sites with ranks given out in the order ``names`` (a permutation of them)."""
        if not names or tuple(names) == tuple(s.name for s in self.sites):
            return self
        by_name = {s.name: s for s in self.sites}
        if sorted(names) != sorted(by_name):
            raise PortingError(
                f"site order {show('>'.join(names))}: expected each of {', '.join(by_name)} once"
            )
        return replace(self, sites=tuple(by_name[n] for n in names))

    def site_orders(self) -> list[tuple[str, ...]]:
        """Orders of the sites a pipeline can run through: every permutation whose consecutive
        sites (and, for three or more, the last and the first) are joined by a link, one of each
        pair that reverses the other (a pipeline that runs backwards crosses the same links).

        All of them, in file order, while there are at most ``MAX_SITE_ORDERS``; past that (12
        fully linked sites have 12!/2), the file order and the ``MAX_SITE_ORDERS - 1`` best
        others by :meth:`order_key` among the rotations of the file order and of a greedy walk
        from each site. Never more than ``MAX_SITE_ORDERS``, whatever the sites and links.
        """
        return list(self._site_orders[0])

    @property
    def every_site_order(self) -> bool:
        """Whether :meth:`site_orders` lists every order the links allow."""
        return self._site_orders[1]

    @cached_property
    def _site_orders(self) -> tuple[tuple[tuple[str, ...], ...], bool]:
        names = [s.name for s in self.sites]
        if len(names) < 2:
            return (tuple(names),), True
        found = self._linked_orders(names)
        if found is not None:
            return tuple(found), True
        index = {name: i for i, name in enumerate(names)}
        cycles = [names] + [c for c in (self._greedy_order(names, x) for x in names) if c]
        seen = {tuple(names)}
        candidates = []
        for cycle in cycles:
            # every rotation: where the pipeline starts decides which site holds the first and
            # the last stage, and which link closes the ring
            for i in range(len(cycle)):
                cand = tuple(cycle[i:] + cycle[:i])
                if index[cand[0]] > index[cand[-1]]:
                    cand = cand[::-1]
                if cand not in seen:
                    seen.add(cand)
                    candidates.append(cand)
        candidates.sort(key=self.order_key)
        return (tuple(names), *candidates[: MAX_SITE_ORDERS - 1]), False

    def _linked_orders(self, names: list[str]) -> list[tuple[str, ...]] | None:
        """Every linked order in lexicographic (file) order, or None once there are more than
        ``MAX_SITE_ORDERS`` or the walk has taken ``MAX_ORDER_STEPS`` steps."""
        n = len(names)
        index = {name: i for i, name in enumerate(names)}
        out: list[tuple[str, ...]] = []
        path: list[str] = []
        used: set[str] = set()
        steps = 0

        def walk() -> bool:
            nonlocal steps
            steps += 1
            if steps > MAX_ORDER_STEPS:
                return False
            if len(path) == n:
                closes = n < 3 or self.linked(path[-1], path[0])
                if closes and index[path[0]] < index[path[-1]]:
                    out.append(tuple(path))
                return len(out) <= MAX_SITE_ORDERS
            for name in names:
                if name in used or (path and not self.linked(path[-1], name)):
                    continue
                path.append(name)
                used.add(name)
                ok = walk()
                path.pop()
                used.discard(name)
                if not ok:
                    return False
            return True

        return out if walk() else None

    def _greedy_order(self, names: list[str], start: str) -> list[str] | None:
        """From ``start``, always on to the unvisited site behind the fastest link; None where
        the walk gets stuck or (three or more sites) cannot close the ring."""
        order, left = [start], set(names) - {start}
        while left:
            here = order[-1]
            options = [x for x in names if x in left and self.linked(here, x)]
            if not options:
                return None
            best = min(options, key=lambda x: _link_rank(self.link(here, x)))
            order.append(best)
            left.discard(best)
        if len(order) > 2 and not self.linked(order[-1], order[0]):
            return None
        return order

    def order_key(self, order: tuple[str, ...]) -> tuple:
        """Sort key of a site order, best first: the slowest link its pipeline crosses (stage
        boundaries run at its pace), then the slowest including the ring's closing link, then
        the longest round trip."""
        path = [self.link(a, b) for a, b in zip(order, order[1:], strict=False)]
        ring = path + ([self.link(order[-1], order[0])] if len(order) > 2 else [])
        return (
            -min(ln.bandwidth * ln.count for ln in path),
            -min(ln.bandwidth * ln.count for ln in ring),
            max(ln.rtt for ln in path),
        )

    def with_links(self, **changes: object) -> Cluster:
        """Every link with the given fields replaced (for sweeps and property tests)."""
        return replace(self, links=tuple(replace(ln, **changes) for ln in self.links))

    def with_memory(self, memory_bytes: float) -> Cluster:
        """Every site's GPU with another memory capacity."""
        sites = tuple(replace(s, gpu=replace(s.gpu, memory_bytes=memory_bytes)) for s in self.sites)
        return replace(self, sites=sites)


def link_rtt(distance_km: float, site_latency: float) -> float:
    """Round trip over fibre: 2 x (5 us/km x km + one switch hop at each end)."""
    return 2 * (FIBRE_US_PER_KM * 1e-6 * distance_km + site_latency)


def _link_rank(ln: Link) -> tuple[float, float]:
    return (-ln.bandwidth * ln.count, ln.rtt)


class _Reader:
    """Typed access to a YAML mapping that names the file and the field path in every error."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, message: str) -> PortingError:
        """An error naming the file and the field path."""
        return PortingError(f"{self.source}: {where}: {message}")

    def mapping(self, value: object, where: str) -> dict:
        """``value`` if it is a mapping."""
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a mapping, got {show(value)}")
        return value

    def get(self, d: dict, key: str, where: str) -> object:
        """A required field."""
        if key not in d or d[key] is None:
            raise self.fail(f"{where}.{key}" if where else key, "missing field")
        return d[key]

    def number(self, d: dict, key: str, where: str, accepted: Range) -> float:
        """A required number inside ``accepted``."""
        path = f"{where}.{key}" if where else key
        return float(accepted.check(self.get(d, key, where), f"{self.source}: {path}"))

    def integer(self, d: dict, key: str, where: str, accepted: Range, default: int | None = None):
        """A required integer inside ``accepted``, or ``default`` when the field is absent."""
        if default is not None and key not in d:
            return default
        path = f"{where}.{key}" if where else key
        return int(accepted.check(self.get(d, key, where), f"{self.source}: {path}"))

    def name(self, value: object, where: str, rule: tuple[re.Pattern, str]) -> str:
        """A name following ``rule`` (a pattern and how to say it): names end up in the
        emitted scripts."""
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise self.fail(where, f"expected a name, got {show(value)}")
        pattern, says = rule
        if not pattern.fullmatch(str(value)):
            raise self.fail(where, f"{show(str(value))} is not a name the planner takes ({says})")
        return str(value)


def _gpu(r: _Reader, d: dict, where: str) -> GPU:
    return GPU(
        name=r.name(d.get("name", "gpu"), f"{where}.name", LABEL),
        peak_flops=r.number(d, "peak_bf16_tflops", where, TFLOPS) * 1e12,
        memory_bytes=r.number(d, "memory_gib", where, MEMORY_GIB) * GIB,
        hbm_bytes_s=r.number(d, "hbm_tbytes_s", where, HBM_TBYTES_S) * 1e12,
    )


def _level(r: _Reader, d: dict, where: str, unit_key: str, accepted: Range, scale: float) -> Level:
    return Level(
        bandwidth=r.number(d, unit_key, where, accepted) * scale,
        latency=r.number(d, "latency_us", where, LATENCY_US) * 1e-6,
    )


def _domains(r: _Reader, d: dict, where: str, nodes: int, site: str) -> tuple[Domain, ...]:
    """A site's ``domains`` list: names, nesting and counts checked against its nodes."""
    raw = d.get("domains")
    if raw is None:
        return ()
    where = f"{where}.domains"
    if not isinstance(raw, list):
        raise r.fail(where, f"expected a list of domains, innermost first, got {show(raw)}")
    if len(raw) > MAX_DOMAINS:
        raise r.fail(where, f"{len(raw)} levels, more than the planner's limit of {MAX_DOMAINS}")
    out: list[Domain] = []
    inner, inner_name = 1, "node"
    inner_latency = r.number(d, "latency_us", where.rsplit(".", 1)[0], LATENCY_US) * 1e-6
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        dom = r.mapping(item, at)
        name = r.name(r.get(dom, "name", at), f"{at}.name", SITE_NAME)
        if name in (x.name for x in out) or name == "node":
            raise r.fail(f"{at}.name", f"a second level named {name!r}")
        count = r.integer(dom, "nodes", at, positive_int(MAX_GPUS))
        if count <= inner or count % inner:
            raise r.fail(
                f"{at}.nodes",
                f"a {name} of {count} nodes does not hold whole {inner_name}s of {inner} nodes "
                "(domains nest, innermost first)",
            )
        if nodes % count:
            raise r.fail(
                f"{at}.nodes",
                f"a {name} of {count} nodes does not divide site {site}'s {nodes} nodes",
            )
        latency = None
        if "latency_us" in dom:
            latency = r.number(dom, "latency_us", at, LATENCY_US) * 1e-6
            if latency < inner_latency:
                raise r.fail(
                    f"{at}.latency_us",
                    f"{latency * 1e6:g} us to leave a {name} is less than the "
                    f"{inner_latency * 1e6:g} us inside it (latencies grow outward)",
                )
            inner_latency = latency
        out.append(
            Domain(
                name=name,
                nodes=count,
                oversubscription=float(
                    OVERSUBSCRIPTION.check(
                        dom.get("oversubscription", 1), f"{r.source}: {at}.oversubscription"
                    )
                ),
                latency=latency,
            )
        )
        inner, inner_name = count, name
    return tuple(out)


def _merged(r: _Reader, top: dict, site: dict, key: str, where: str) -> tuple[dict, str]:
    """Site-level section over the top-level one; the path of whichever supplies the field."""
    if key in site:
        base = dict(r.mapping(top.get(key, {}) or {}, key)) if key in top else {}
        base.update(r.mapping(site[key], f"{where}.{key}"))
        return base, f"{where}.{key}"
    if key not in top:
        raise r.fail(f"{where}.{key}", "missing field (give it per site or at the top level)")
    return r.mapping(top[key], key), key


def cluster_from_dict(data: object, source: str = "cluster") -> Cluster:
    """Validate a parsed cluster description (see the module docstring for the schema).

    Every number is checked against its range (the constants above, and ``MAX_SITES`` /
    ``MAX_GPUS`` from :mod:`porting.planner.limits`) before it is used.
    """
    r = _Reader(source)
    top = r.mapping(data, "top level")
    sites = _sites(r, top)
    links = _links(r, top, {s.name: s for s in sites})
    nccl = _nccl(r, top)
    if "name" in top:
        name = r.name(top["name"], "name", LABEL)
    else:
        name = re.sub(r"[^A-Za-z0-9._+-]", "_", Path(source).stem)[:128] or "cluster"
    cluster = Cluster(name=name, sites=tuple(sites), links=tuple(links), nccl=nccl)
    try:
        cluster.ring_links()
    except PortingError as err:
        raise r.fail("links", f"{err} (sites talk in a ring in file order)") from None
    return cluster


def _sites(r: _Reader, top: dict) -> list[Site]:
    """The ``sites`` list: each site's GPUs, node and network (its own or the file's), and its
    racks and zones; the GPUs of all sites within the planner's limit."""
    raw_sites = r.get(top, "sites", "")
    if not isinstance(raw_sites, list) or not raw_sites:
        raise r.fail("sites", f"expected a non-empty list of sites, got {show(raw_sites)}")
    if len(raw_sites) > MAX_SITES:
        raise r.fail(
            "sites", f"{len(raw_sites)} sites is more than the planner's limit of {MAX_SITES}"
        )
    sites: list[Site] = []
    world = 0
    for i, raw in enumerate(raw_sites):
        where = f"sites[{i}]"
        d = r.mapping(raw, where)
        name = r.name(r.get(d, "name", where), f"{where}.name", SITE_NAME)
        if any(s.name == name for s in sites):
            raise r.fail(f"{where}.name", f"duplicate site name {name!r}")
        gpu_d, gpu_where = _merged(r, top, d, "gpu", where)
        node_d, node_where = _merged(r, top, d, "node", where)
        net_d, net_where = _merged(r, top, d, "site", where)
        nodes = r.integer(d, "nodes", where, positive_int(MAX_GPUS))
        site = Site(
            name=name,
            nodes=nodes,
            gpus_per_node=r.integer(d, "gpus_per_node", where, positive_int(MAX_GPUS_PER_NODE)),
            gpu=_gpu(r, gpu_d, gpu_where),
            node=_level(r, node_d, node_where, "bandwidth_gbytes_s", NODE_GBYTES_S, 1e9),
            net=_level(r, net_d, net_where, "bandwidth_gbit_s", NET_GBIT_S, 1e9 / 8),
            domains=_domains(r, net_d, net_where, nodes, name),
        )
        world += site.gpus
        if world > MAX_GPUS:
            raise r.fail(
                f"{where}.nodes",
                f"{world} GPUs up to this site is more than the planner's limit of {MAX_GPUS} "
                "GPUs in all sites",
            )
        sites.append(site)
    return sites


def _links(r: _Reader, top: dict, by_name: dict[str, Site]) -> list[Link]:
    """The ``links`` between sites: each pair once, its length (or round trip), bandwidth,
    count and transport."""
    links: list[Link] = []
    pairs: set[frozenset[str]] = set()
    raw_links = top.get("links") or []
    if not isinstance(raw_links, list):
        raise r.fail("links", f"expected a list, got {show(raw_links)}")
    most = len(by_name) * (len(by_name) - 1) // 2
    if len(raw_links) > most:
        raise r.fail(
            "links", f"{len(raw_links)} links, more than the {most} pairs of {len(by_name)} sites"
        )
    for i, raw in enumerate(raw_links):
        where = f"links[{i}]"
        d = r.mapping(raw, where)
        pair = r.get(d, "sites", where)
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not all(isinstance(x, str) for x in pair)
            or pair[0] == pair[1]
        ):
            raise r.fail(f"{where}.sites", f"expected two different site names, got {show(pair)}")
        for end in pair:
            if end not in by_name:
                raise r.fail(
                    f"{where}.sites",
                    f"unknown site {show(end)} (sites: {', '.join(by_name)})",
                )
        a, b = pair
        if frozenset(pair) in pairs:
            raise r.fail(f"{where}.sites", f"a second link between {a!r} and {b!r}; use count")
        pairs.add(frozenset(pair))
        transport = d.get("transport", "rdma")
        if not isinstance(transport, str) or transport.lower() not in ("rdma", "tcp"):
            raise r.fail(f"{where}.transport", f"expected rdma or tcp, got {show(transport)}")
        transport = transport.lower()
        distance = None
        if "rtt_ms" in d:
            rtt = r.number(d, "rtt_ms", where, RTT_MS) * 1e-3
        elif "distance_km" in d:
            distance = r.number(d, "distance_km", where, DISTANCE_KM)
            edge = max(by_name[a].net.latency, by_name[b].net.latency)
            rtt = link_rtt(distance, edge)
        else:
            raise r.fail(f"{where}.distance_km", "missing field (or give rtt_ms)")
        links.append(
            Link(
                a=a,
                b=b,
                bandwidth=r.number(d, "bandwidth_gbit_s", where, NET_GBIT_S) * 1e9 / 8,
                count=r.integer(d, "count", where, positive_int(MAX_LINK_COUNT), default=1),
                rtt=rtt,
                transport=transport,
                distance_km=distance,
            )
        )
    return links


def _nccl(r: _Reader, top: dict) -> NcclSettings:
    """The file's ``nccl`` settings, each within its range (NCCL's defaults where absent)."""
    nccl_d = r.mapping(top.get("nccl", {}) or {}, "nccl")
    return NcclSettings(
        buffsize=int(r.number(nccl_d, "buffsize_mib", "nccl", BUFFSIZE_MIB) * MIB)
        if "buffsize_mib" in nccl_d
        else NcclSettings.buffsize,
        channels=r.integer(nccl_d, "channels", "nccl", CHANNELS, default=NcclSettings.channels),
        qps_per_connection=r.integer(nccl_d, "qps_per_connection", "nccl", QPS, default=1),
        socket_threads=r.integer(nccl_d, "socket_threads", "nccl", SOCKETS, default=1),
        socks_per_thread=r.integer(nccl_d, "socks_per_thread", "nccl", SOCKETS, default=1),
    )


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster YAML file (at most ``MAX_CLUSTER_BYTES``)."""
    p = Path(path)
    text = read_text(p, f"--cluster {p}", MAX_CLUSTER_BYTES)
    return cluster_from_dict(parse_yaml(text, str(p)), str(p))
