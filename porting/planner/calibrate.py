"""Calibration: read nccl-tests logs and a measured step time, refit the efficiency constants.

nccl-tests (github.com/NVIDIA/nccl-tests) print one row per message size: ``size count type
redop root`` then, out of place and in place, ``time (us) algbw busbw #wrong``; a header lists
every rank as ``#  Rank  N Group G Pid P on HOST device D``. Bus bandwidth already folds in the
``2(n-1)/n`` ring factor, so the largest messages' busbw is the per-rank bandwidth the comm model
calls ``bw``, and the smallest messages' time is its latency term.

The log's name says which level it measured: ``node_*``, ``site-<site>_*`` (or ``site_*``) and
``link-<a>-<b>_*``, as ``nccl_tests.sh`` (from ``--emit``) writes them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from porting.errors import PortingError
from porting.planner.alltoall import per_copy_time
from porting.planner.cluster import Cluster
from porting.planner.comm import (
    EFFICIENCY_RANGES,
    Efficiency,
    Network,
    allreduce,
    check_efficiency,
    p2p,
)
from porting.planner.experts import gemm_seconds
from porting.planner.limits import (
    MAX_CONSTANTS_BYTES,
    MAX_GEMM_ROWS,
    MAX_LOG_BYTES,
    MAX_LOGS,
    MAX_LOGS_BYTES,
    Range,
    parse_yaml,
    read_text,
    show,
)
from porting.planner.perf import Evaluator, Layout
from porting.planner.placement import NODE, SITE, WAN, GroupShape

_RANK = re.compile(r"^#\s*Rank\s+([0-9]{1,9})\s+Group\s+[0-9]+\s+Pid\s+[0-9]+\s+on\s+(\S+)")
# A row's message size (bytes, up to 1 PiB), time (us, up to a day) and bus bandwidth (GB/s)
ROW_BYTES = Range(0, 1 << 50, integer=True)
ROW_TIME_US = Range(0, 86_400e6)
ROW_BUSBW_GB_S = Range(0, 1e6)
_COLLECTIVE = re.compile(r"(all_reduce|all_gather|reduce_scatter|sendrecv|alltoall|broadcast)")


@dataclass(frozen=True)
class NcclTest:
    """One nccl-tests log: which level, which collective, how many ranks and nodes, the rows."""

    path: str
    level: int
    link: str | None  # "a-b" as in the file name; resolved against the cluster's sites
    site: str | None
    collective: str
    ranks: int
    nodes: int
    rows: tuple[tuple[int, float, float], ...]  # (bytes, time in seconds, busbw in bytes/s)

    @property
    def busbw(self) -> float:
        """Bus bandwidth at the largest messages (bytes/s): the rows within a factor 4 of the
        largest, which in nccl-tests' doubling sweep are its last three. Counting rows instead
        let a sparse sweep's small message, which a token-bucket link passes at burst speed,
        stand for the link's bandwidth (fitted efficiencies above 1)."""
        return max(r[2] for r in large_rows(self.rows))

    @property
    def small_time(self) -> float:
        """Time of the smallest message (seconds): the latency term."""
        return self.rows[0][1]


def large_rows(rows):
    """The sorted rows within a factor 4 of the largest message: the bandwidth regime."""
    return [r for r in rows if r[0] * 4 >= rows[-1][0]]


def parse_nccl_test(path: str | Path) -> NcclTest:
    """Parse one nccl-tests log; the level comes from the file name."""
    p = Path(path)
    text = read_text(p, str(p), MAX_LOG_BYTES)
    name = p.name
    link = site = None
    tail = re.match(r"^(node|site|link)(?:-(.+?))?_(?:" + _COLLECTIVE.pattern[1:-1] + ")", name)
    if name.startswith("node"):
        level = NODE
    elif name.startswith("site"):
        level = SITE
        site = tail.group(2) if tail else None
    elif name.startswith("link-"):
        level = WAN
        if not tail or not tail.group(2) or "-" not in tail.group(2):
            raise PortingError(f"{p}: cannot tell the two sites from the name (link-A-B_*.log)")
        link = tail.group(2)
    else:
        raise PortingError(f"{p}: name must start with node, site or link-A-B (the level)")
    found = _COLLECTIVE.search(name) or _COLLECTIVE.search(text)
    if not found:
        raise PortingError(f"{p}: cannot tell the collective (all_reduce, sendrecv, ...)")
    hosts: dict[int, str] = {}
    rows: list[tuple[int, float, float]] = []
    for number, line in enumerate(text.splitlines(), 1):
        m = _RANK.match(line.strip())
        if m:
            hosts[int(m.group(1))] = m.group(2)
            continue
        if line.lstrip().startswith("#") or not line.strip():
            continue
        tok = line.split()
        if not (tok[0].isascii() and tok[0].isdigit()) or len(tok) < 9:
            continue
        try:
            size = int(tok[0])
            t_us, busbw = float(tok[-8]), float(tok[-6])
        except ValueError:
            continue
        where = f"{p}: line {number}"
        ROW_BYTES.check(size, f"{where}: size")
        ROW_TIME_US.check(t_us, f"{where}: time (us)")
        ROW_BUSBW_GB_S.check(busbw, f"{where}: busbw (GB/s)")
        rows.append((size, t_us * 1e-6, busbw * 1e9))
    if not rows:
        raise PortingError(f"{p}: no result rows (size count type ... time algbw busbw)")
    if not hosts:
        raise PortingError(f"{p}: no '# Rank N ... on HOST' lines; cannot tell the rank count")
    if len(hosts) < 2 and found.group(1) != "sendrecv":
        raise PortingError(f"{p}: {len(hosts)} rank; a collective over one rank measures nothing")
    rows.sort()
    if rows[-1][0] <= 0 or max(r[2] for r in large_rows(rows)) <= 0:
        raise PortingError(f"{p}: the largest messages show no bandwidth (size or busbw 0)")
    return NcclTest(
        path=str(p),
        level=level,
        link=link,
        site=site,
        collective=found.group(1),
        ranks=len(hosts),
        nodes=len(set(hosts.values())),
        rows=tuple(rows),
    )


def load_nccl_tests(directory: str | Path) -> list[NcclTest]:
    """Every ``*.log``/``*.txt`` nccl-tests output in ``directory`` (none where the directory
    holds only grouped-GEMM logs, :func:`load_gemm_logs`)."""
    d = Path(directory)
    if not d.is_dir():
        raise PortingError(f"--calibrate {d}: not a directory")
    files = []
    gemm = False
    for f in d.iterdir():
        gemm = gemm or _is_gemm_log(f)
        if f.suffix in (".log", ".txt", ".out"):
            _inside(d, f)
            files.append(f)
            if len(files) > MAX_LOGS:
                raise PortingError(
                    f"--calibrate {d}: more than the planner's limit of {MAX_LOGS} logs"
                )
    if not files:
        if gemm:
            return []
        raise PortingError(
            f"--calibrate {d}: no nccl-tests logs (*.log, *.txt, *.out) and no grouped-GEMM "
            "log (grouped_gemm*.csv)"
        )
    total = sum(f.stat().st_size for f in files if f.is_file())
    if total > MAX_LOGS_BYTES:
        raise PortingError(
            f"--calibrate {d}: {total} bytes of logs is more than the planner's limit of "
            f"{MAX_LOGS_BYTES}"
        )
    return [parse_nccl_test(f) for f in sorted(files)]


def _test_shape(cluster: Cluster, t: NcclTest) -> GroupShape:
    per_node = max(1, t.ranks // max(1, t.nodes))
    if t.level == WAN:
        return GroupShape(t.ranks, WAN, per_node, (resolve_link(cluster, t),), 1)
    return GroupShape(t.ranks, t.level, per_node, (), 1)


def resolve_link(cluster: Cluster, t: NcclTest):
    """The cluster link a ``link-A-B_*`` log measured (site names may contain hyphens)."""
    raw = t.link or ""
    names = {s.name for s in cluster.sites}
    for i, ch in enumerate(raw):
        if ch == "-" and raw[:i] in names and raw[i + 1 :] in names:
            return cluster.link(raw[:i], raw[i + 1 :])
    raise PortingError(f"{t.path}: {raw!r} does not name two sites of the cluster")


def predict_test(cluster: Cluster, eff: Efficiency, t: NcclTest, size: float) -> float:
    """What the comm model predicts for one nccl-tests row of ``size`` bytes (seconds)."""
    net = Network(cluster, eff, tune=False)
    shape = _test_shape(cluster, t)
    if t.collective == "alltoall":
        # nccl-tests' alltoall: each rank sends size / ranks to every rank, itself included
        nvlink, network, latency = net.all_to_all(shape)
        return per_copy_time(1, 1, size, t.ranks, shape.members_per_node, nvlink, network, latency)
    path = net.path(shape)
    if t.collective == "sendrecv":
        return p2p(size, path)
    if t.collective in ("all_gather", "reduce_scatter"):
        n = t.ranks
        return (n - 1) * path.latency + (n - 1) / n * size / path.bandwidth
    return allreduce(t.ranks, size, path)


def _steps(t: NcclTest) -> float:
    n = t.ranks
    if t.collective == "sendrecv":
        return 1
    if t.collective in ("all_gather", "reduce_scatter", "alltoall"):
        return n - 1
    return min(2 * (n - 1), 2 * math.ceil(math.log2(max(n, 2))))


@dataclass(frozen=True)
class LevelFit:
    """Measured against predicted for one log, and the constant it set."""

    path: str
    level: str
    predicted_busbw: float
    measured_busbw: float
    predicted_latency: float
    measured_latency: float
    constant: str
    value: float


def fit_levels(
    cluster: Cluster, eff: Efficiency, tests: list[NcclTest]
) -> tuple[Efficiency, list[LevelFit]]:
    """Refit bandwidth efficiency and latency per level from nccl-tests logs.

    Each log scales its level's efficiency by measured / predicted bus bandwidth; for a link this
    assumes the link (not the NICs) limits the test, as it does across sites. An ``alltoall`` log
    sets the all-to-all's own constants instead (``a2a_node_bw`` from a node's, ``a2a_net_bw``
    between nodes of a site, ``a2a_wan_bw`` over a link, and ``a2a_latency`` from its smallest
    message), which the MoE layers' dispatch and combine use.
    """
    fits: list[LevelFit] = []
    for t in tests:
        if t.collective not in (
            "all_reduce",
            "sendrecv",
            "all_gather",
            "reduce_scatter",
            "alltoall",
        ):
            continue
        big = t.rows[-1][0]
        before = predict_test(cluster, eff, t, big)
        pred_busbw = _busbw(t, big, before)
        scale = t.busbw / pred_busbw
        if t.collective == "alltoall":
            name = ("a2a_node_bw", "a2a_net_bw", "a2a_wan_bw")[t.level]
            value = getattr(eff, name) * scale
            small = t.rows[0][0]
            fixed = eff.a2a_latency
            transfer = predict_test(cluster, replace(eff, **{name: value}), t, small) - fixed
            eff = replace(eff, **{name: value}, a2a_latency=max(0.0, t.small_time - transfer))
        elif t.level == NODE:
            name, value = "node_bw", eff.node_bw * scale
            lat = t.small_time / _steps(t)
            eff = replace(eff, node_bw=value, node_latency=lat)
        elif t.level == SITE:
            name, value = "site_bw", eff.site_bw * scale
            lat = t.small_time / _steps(t)
            eff = replace(eff, site_bw=value, site_latency=lat)
        else:
            link = resolve_link(cluster, t)
            name = "wan_tcp" if link.transport == "tcp" else "wan_rdma"
            value = getattr(eff, name) * scale
            small = t.rows[0][0]
            lat_before = predict_test(cluster, eff, t, small)
            eff = replace(eff, **{name: value})
            eff = replace(eff, wan_latency_scale=eff.wan_latency_scale * t.small_time / lat_before)
        check_efficiency(eff, f"{t.path}: fitted")
        fits.append(
            LevelFit(
                path=t.path,
                level=("node", "site", "wan")[t.level],
                predicted_busbw=pred_busbw,
                measured_busbw=t.busbw,
                predicted_latency=predict_test(cluster, eff, t, t.rows[0][0]),
                measured_latency=t.small_time,
                constant=name,
                value=value,
            )
        )
    return eff, fits


def _busbw(t: NcclTest, size: float, seconds: float) -> float:
    """nccl-tests' bus bandwidth of a ``size``-byte operation taking ``seconds``."""
    n = t.ranks
    algbw = size / seconds
    if t.collective == "all_reduce":
        return algbw * 2 * (n - 1) / n
    if t.collective in ("all_gather", "reduce_scatter", "alltoall"):
        return algbw * (n - 1) / n
    return algbw


def fit_step(ev: Evaluator, layout: Layout, measured: float) -> Efficiency:
    """The compute efficiency that makes ``layout``'s predicted step equal ``measured``.

    Step time falls monotonically as the efficiency rises, so bisection on [0.01, 1] finds it;
    a measurement outside what any efficiency can explain is an error naming the bounds.
    """

    def step(c: float) -> float:
        """Predicted step at compute efficiency ``c``."""
        return _with_eff(ev, replace(ev.eff, compute=c)).predict(layout).step

    lo, hi = 0.01, 1.0
    if not step(hi) <= measured <= step(lo):
        raise PortingError(
            f"--measured-step {measured}: outside what the model explains for {layout.label()} "
            f"({step(hi):.3g} s at 100% compute efficiency to {step(lo):.3g} s at 1%); "
            "check the layout and the cluster file"
        )
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if step(mid) > measured:
            lo = mid
        else:
            hi = mid
    return replace(ev.eff, compute=math.sqrt(lo * hi))


def _with_eff(ev: Evaluator, eff: Efficiency) -> Evaluator:
    return Evaluator(ev.model, ev.cluster, ev.seq, ev.global_batch, ev.settings, eff)


def fit_constants(
    observations: list[tuple[Evaluator, Layout, float]],
    eff: Efficiency,
    names: tuple[str, ...] = ("compute", "memory_passes"),
) -> Efficiency:
    """Fit up to two constants so that each observation's step equals its measured time.

    Newton's method on the log of predicted/measured, with finite-difference derivatives: the
    step time is close to linear in 1/compute and in memory_passes, so it converges in a few
    iterations. Needs as many observations as constants.
    """
    if len(observations) < len(names):
        raise PortingError(f"fitting {len(names)} constants needs as many measurements")
    obs = observations[: len(names)]

    def residual(values: list[float]) -> list[float]:
        """log(predicted / measured) per observation."""
        e = replace(eff, **dict(zip(names, values, strict=True)))
        return [math.log(_with_eff(ev, e).predict(lay).step / meas) for ev, lay, meas in obs]

    x = [getattr(eff, n) for n in names]
    for _ in range(20):
        r = residual(x)
        if max(abs(v) for v in r) < 1e-9:
            break
        jac = []
        for j in range(len(x)):
            dx = list(x)
            dx[j] *= 1.001
            rj = residual(dx)
            jac.append([(rj[i] - r[i]) / (x[j] * 0.001) for i in range(len(r))])
        step = _solve([[jac[j][i] for j in range(len(x))] for i in range(len(r))], r)
        x = [max(1e-3, xi - si) for xi, si in zip(x, step, strict=True)]
    return replace(eff, **dict(zip(names, x, strict=True)))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a 1x1 or 2x2 linear system."""
    if len(b) == 1:
        return [b[0] / a[0][0]]
    det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
    if det == 0:
        raise PortingError("the measurements do not separate the constants (singular fit)")
    return [
        (b[0] * a[1][1] - a[0][1] * b[1]) / det,
        (a[0][0] * b[1] - b[0] * a[1][0]) / det,
    ]


def load_constants(path: str | Path) -> Efficiency:
    """Efficiency constants from a YAML file written by ``--save-constants``."""
    p = Path(path)
    data = parse_yaml(read_text(p, f"--constants {p}", MAX_CONSTANTS_BYTES), str(p)) or {}
    if not isinstance(data, dict):
        raise PortingError(f"{p}: expected a mapping of constant names to numbers")
    for key, value in data.items():
        if key not in EFFICIENCY_RANGES:
            known = ", ".join(sorted(EFFICIENCY_RANGES))
            raise PortingError(f"{p}: {show(key)}: unknown constant (known: {known})")
        if value is not None or key not in ("node_latency", "site_latency"):
            EFFICIENCY_RANGES[key].check(value, f"{p}: {key}")
    return replace(Efficiency(), **data)


# A grouped-GEMM benchmark log (``grouped_gemm*.csv``, as the emitted ``gemm_bench.py`` writes
# it): a header naming at least ``groups,m,n,k`` and ``ms`` (or ``us``), then a row per shape:
# ``groups`` experts each multiplying ``m`` rows by a ``k`` x ``n`` weight, timed per call;
# ``grouped`` (1 or 0, default 1) says whether one launch ran all of them. ``#`` starts a comment.
GEMM_COLUMNS = ("groups", "m", "n", "k")
GEMM_SHAPE = Range(1, 1 << 20, integer=True)
GEMM_MS = Range(1e-6, 3_600_000)


@dataclass(frozen=True)
class GemmRow:
    """One measured GEMM shape."""

    path: str
    groups: int
    rows: int
    n: int
    k: int
    seconds: float
    grouped: bool


def _is_gemm_log(f: Path) -> bool:
    return f.name.startswith("grouped_gemm") and f.suffix == ".csv"


def load_gemm_logs(directory: str | Path) -> list[GemmRow]:
    """Every grouped-GEMM log in ``directory`` (``grouped_gemm*.csv``), parsed."""
    d = Path(directory)
    rows: list[GemmRow] = []
    for f in sorted(d.iterdir()):
        if _is_gemm_log(f):
            _inside(d, f)
            rows.extend(parse_gemm_log(f))
            if len(rows) > MAX_GEMM_ROWS:
                raise PortingError(
                    f"--calibrate {d}: more than the planner's limit of {MAX_GEMM_ROWS} "
                    "grouped-GEMM rows"
                )
    return rows


def _inside(d: Path, f: Path) -> None:
    """A log is read only where it lies inside the directory given (a link out of it is not)."""
    if not f.resolve().is_relative_to(d.resolve()):
        raise PortingError(f"{f}: a link out of --calibrate {d}; refused")


def parse_gemm_log(path: str | Path) -> list[GemmRow]:
    """Parse one grouped-GEMM log; every bad line is an error naming the file and the line."""
    p = Path(path)
    text = read_text(p, str(p), MAX_LOG_BYTES)
    header: list[str] | None = None
    out: list[GemmRow] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cells = [c.strip() for c in line.split(",")]
        where = f"{p}: line {number}"
        if header is None:
            header = [c.lower() for c in cells]
            missing = [c for c in GEMM_COLUMNS if c not in header]
            if missing or not ({"ms", "us"} & set(header)):
                raise PortingError(
                    f"{where}: the header must name groups, m, n, k and ms (or us); "
                    f"got {show(line)}"
                )
            continue
        if len(cells) != len(header):
            raise PortingError(f"{where}: {len(cells)} values for {len(header)} columns")
        row = dict(zip(header, cells, strict=True))
        try:
            shape = {c: int(row[c]) for c in GEMM_COLUMNS}
            t = float(row["ms"]) * 1e-3 if "ms" in row else float(row["us"]) * 1e-6
            grouped = row.get("grouped", "1") not in ("0", "false", "False")
        except ValueError:
            raise PortingError(f"{where}: not a number in {show(line)}") from None
        for c in GEMM_COLUMNS:
            GEMM_SHAPE.check(shape[c], f"{where}: {c}")
        GEMM_MS.check(t * 1e3, f"{where}: time (ms)")
        out.append(GemmRow(str(p), shape["groups"], shape["m"], shape["n"], shape["k"], t, grouped))
    if not out:
        raise PortingError(f"{p}: no measured rows (groups,m,n,k,ms)")
    return out


def predict_gemm(row: GemmRow, peak: float, hbm: float, eff: Efficiency) -> float:
    """What the expert-GEMM model predicts for one logged shape (seconds)."""
    return gemm_seconds(row.rows, row.k, row.n, row.groups, peak, hbm, eff, grouped=row.grouped)


def fit_experts(
    rows: list[GemmRow], peak: float, hbm: float, eff: Efficiency
) -> tuple[Efficiency, float, float]:
    """Refit ``expert_compute``, ``expert_hbm`` and ``expert_launch`` to a grouped-GEMM log.

    Minimises the root mean square of log(predicted / measured) by a search over the three
    (each a geometric grid, then refined around the best twice): the model is a smooth roofline,
    so the error surface has one basin. Returns the constants and the worst relative error
    before and after.
    """
    if not rows:
        return eff, 0.0, 0.0

    def errors(e: Efficiency) -> list[float]:
        return [math.log(predict_gemm(r, peak, hbm, e) / r.seconds) for r in rows]

    def rms(e: Efficiency) -> float:
        return math.sqrt(sum(x * x for x in errors(e)) / len(rows))

    def worst(e: Efficiency) -> float:
        return max(math.exp(abs(x)) - 1 for x in errors(e))

    before = worst(eff)
    centre = (eff.expert_compute, eff.expert_hbm, max(eff.expert_launch, 1e-7))
    span = 4.0
    best = (rms(eff), eff)
    for _ in range(3):
        grid = [span ** ((i - 4) / 4) for i in range(9)]
        for a in grid:
            for b in grid:
                for c in grid:
                    e = replace(
                        eff,
                        expert_compute=min(1.0, centre[0] * a),
                        expert_hbm=min(1.0, centre[1] * b),
                        expert_launch=min(0.01, centre[2] * c),
                    )
                    r = rms(e)
                    if r < best[0]:
                        best = (r, e)
        e = best[1]
        centre = (e.expert_compute, e.expert_hbm, max(e.expert_launch, 1e-7))
        span = math.sqrt(span)
    fitted = best[1]
    check_efficiency(fitted, f"{rows[0].path}: fitted")
    return fitted, before, worst(fitted)
