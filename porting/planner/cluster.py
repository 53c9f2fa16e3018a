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
A link gives ``distance_km`` (fibre: about 5 microseconds per km one way) or a measured
``rtt_ms``. Every error names the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from porting.errors import PortingError

# Light in fibre travels at about c/1.47, i.e. ~4.9 us per km one way; 5 us/km is the usual
# planning figure (and what the DESIGN notes measured across sites).
FIBRE_US_PER_KM = 5.0
MIB = 1 << 20
GIB = 1 << 30


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
class Site:
    """A data centre (or a partition of one): identical nodes on one fabric."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPU
    node: Level  # inside a node (NVLink/NVSwitch)
    net: Level  # between nodes of this site (per-GPU NIC)

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

    def link(self, a: str, b: str) -> Link:
        """The link between sites ``a`` and ``b`` (either order)."""
        for ln in self.links:
            if {ln.a, ln.b} == {a, b}:
                return ln
        raise PortingError(f"links: no link between sites {a!r} and {b!r}")

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
        merged = replace(first, name="one-site", nodes=self.world // gpn)
        return Cluster(name=f"{self.name} (one site)", sites=(merged,), nccl=self.nccl)

    def reordered(self, names: tuple[str, ...]) -> Cluster:
        """The same sites with ranks given out in the order ``names`` (a permutation of them)."""
        if not names or tuple(names) == tuple(s.name for s in self.sites):
            return self
        by_name = {s.name: s for s in self.sites}
        if sorted(names) != sorted(by_name):
            raise PortingError(
                f"site order {'>'.join(names)}: expected each of {', '.join(by_name)} once"
            )
        return replace(self, sites=tuple(by_name[n] for n in names))

    def site_orders(self) -> list[tuple[str, ...]]:
        """Orders of the sites a pipeline can run through: every permutation whose consecutive
        sites (and, for three or more, the last and the first) are joined by a link, one of each
        pair that reverses the other (a pipeline that runs backwards crosses the same links)."""
        from itertools import permutations

        names = [s.name for s in self.sites]
        if len(names) < 2:
            return [tuple(names)]
        out = []
        for perm in permutations(names):
            if names.index(perm[0]) > names.index(perm[-1]):
                continue
            try:
                self.reordered(perm).ring_links()
            except PortingError:
                continue
            out.append(perm)
        return out

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
            raise self.fail(where, "expected a mapping")
        return value

    def get(self, d: dict, key: str, where: str) -> object:
        """A required field."""
        if key not in d or d[key] is None:
            raise self.fail(f"{where}.{key}" if where else key, "missing field")
        return d[key]

    def number(self, d: dict, key: str, where: str, *, positive: bool = True) -> float:
        """A required number, > 0 (or >= 0 when ``positive`` is False)."""
        value = self.get(d, key, where)
        path = f"{where}.{key}" if where else key
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(path, f"expected a number, got {value!r}")
        if positive and value <= 0:
            raise self.fail(path, f"must be > 0, got {value!r}")
        if not positive and value < 0:
            raise self.fail(path, f"must be >= 0, got {value!r}")
        return float(value)

    def integer(self, d: dict, key: str, where: str, default: int | None = None) -> int:
        """A positive integer, or ``default`` when the field is absent and a default is given."""
        if default is not None and key not in d:
            return default
        value = self.get(d, key, where)
        path = f"{where}.{key}" if where else key
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(path, f"must be a positive integer, got {value!r}")
        return value


def _gpu(r: _Reader, d: dict, where: str) -> GPU:
    return GPU(
        name=str(d.get("name", "gpu")),
        peak_flops=r.number(d, "peak_bf16_tflops", where) * 1e12,
        memory_bytes=r.number(d, "memory_gib", where) * GIB,
        hbm_bytes_s=r.number(d, "hbm_tbytes_s", where) * 1e12,
    )


def _level(r: _Reader, d: dict, where: str, unit_key: str, scale: float) -> Level:
    return Level(
        bandwidth=r.number(d, unit_key, where) * scale,
        latency=r.number(d, "latency_us", where, positive=False) * 1e-6,
    )


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
    """Validate a parsed cluster description (see the module docstring for the schema)."""
    r = _Reader(source)
    top = r.mapping(data, "top level")
    raw_sites = r.get(top, "sites", "")
    if not isinstance(raw_sites, list) or not raw_sites:
        raise r.fail("sites", "expected a non-empty list of sites")
    sites: list[Site] = []
    for i, raw in enumerate(raw_sites):
        where = f"sites[{i}]"
        d = r.mapping(raw, where)
        name = str(r.get(d, "name", where))
        if any(s.name == name for s in sites):
            raise r.fail(f"{where}.name", f"duplicate site name {name!r}")
        gpu_d, gpu_where = _merged(r, top, d, "gpu", where)
        node_d, node_where = _merged(r, top, d, "node", where)
        net_d, net_where = _merged(r, top, d, "site", where)
        sites.append(
            Site(
                name=name,
                nodes=r.integer(d, "nodes", where),
                gpus_per_node=r.integer(d, "gpus_per_node", where),
                gpu=_gpu(r, gpu_d, gpu_where),
                node=_level(r, node_d, node_where, "bandwidth_gbytes_s", 1e9),
                net=_level(r, net_d, net_where, "bandwidth_gbit_s", 1e9 / 8),
            )
        )
    by_name = {s.name: s for s in sites}
    links: list[Link] = []
    raw_links = top.get("links") or []
    if not isinstance(raw_links, list):
        raise r.fail("links", "expected a list")
    for i, raw in enumerate(raw_links):
        where = f"links[{i}]"
        d = r.mapping(raw, where)
        pair = r.get(d, "sites", where)
        if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
            raise r.fail(f"{where}.sites", f"expected two different site names, got {pair!r}")
        for end in pair:
            if end not in by_name:
                raise r.fail(
                    f"{where}.sites",
                    f"unknown site {end!r} (sites: {', '.join(by_name)})",
                )
        a, b = (str(x) for x in pair)
        if any({ln.a, ln.b} == {a, b} for ln in links):
            raise r.fail(f"{where}.sites", f"a second link between {a!r} and {b!r}; use count")
        transport = str(d.get("transport", "rdma")).lower()
        if transport not in ("rdma", "tcp"):
            raise r.fail(f"{where}.transport", f"expected rdma or tcp, got {transport!r}")
        distance = None
        if "rtt_ms" in d:
            rtt = r.number(d, "rtt_ms", where) * 1e-3
        elif "distance_km" in d:
            distance = r.number(d, "distance_km", where, positive=False)
            edge = max(by_name[a].net.latency, by_name[b].net.latency)
            rtt = link_rtt(distance, edge)
        else:
            raise r.fail(f"{where}.distance_km", "missing field (or give rtt_ms)")
        links.append(
            Link(
                a=a,
                b=b,
                bandwidth=r.number(d, "bandwidth_gbit_s", where) * 1e9 / 8,
                count=r.integer(d, "count", where, default=1),
                rtt=rtt,
                transport=transport,
                distance_km=distance,
            )
        )
    nccl_d = r.mapping(top.get("nccl", {}) or {}, "nccl")
    nccl = NcclSettings(
        buffsize=int(r.number(nccl_d, "buffsize_mib", "nccl") * MIB)
        if "buffsize_mib" in nccl_d
        else NcclSettings.buffsize,
        channels=r.integer(nccl_d, "channels", "nccl", default=NcclSettings.channels),
        qps_per_connection=r.integer(nccl_d, "qps_per_connection", "nccl", default=1),
        socket_threads=r.integer(nccl_d, "socket_threads", "nccl", default=1),
        socks_per_thread=r.integer(nccl_d, "socks_per_thread", "nccl", default=1),
    )
    cluster = Cluster(
        name=str(top.get("name", Path(source).stem)),
        sites=tuple(sites),
        links=tuple(links),
        nccl=nccl,
    )
    try:
        cluster.ring_links()
    except PortingError as err:
        raise r.fail("links", f"{err} (sites talk in a ring in file order)") from None
    return cluster


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster YAML file."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise PortingError(f"--cluster {p}: cannot read ({err})") from err
    except yaml.YAMLError as err:
        raise PortingError(f"{p}: not valid YAML ({err})") from err
    return cluster_from_dict(data, str(p))
