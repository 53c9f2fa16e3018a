"""Where the ranks of each parallel group sit: node, site, and which inter-site links they cross.

Ranks are numbered site by site, node by node (the order the emitted launchers start them in).
A rank's coordinates in a layout follow Megatron-Core's ``RankGenerator``
(``megatron/core/parallel_state.py``): the ``order`` string lists the dimensions from fastest to
slowest varying, and a group is every rank that differs only in the group's dimensions. Megatron's
default order is ``tp-cp-ep-dp-pp`` (pipeline outermost); ``use_tp_pp_dp_mapping`` selects
``tp-cp-ep-pp-dp`` (data parallel outermost), which keeps a model replica inside a block of
consecutive ranks and so inside a site. Tests check these groups against Megatron's own generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from porting.errors import PortingError
from porting.planner.cluster import Cluster, Link

ORDER_TP_PP_DP = "tp-cp-ep-pp-dp"
ORDER_DEFAULT = "tp-cp-ep-dp-pp"
NODE, SITE, WAN = 0, 1, 2
LEVEL_NAMES = ("node", "site", "wan")


@dataclass(frozen=True)
class GroupShape:
    """What the comm model needs to know about one kind of group (the worst over all groups)."""

    size: int
    level: int  # NODE, SITE or WAN: the widest level any group of this kind spans
    members_per_node: int  # fewest members of one group on one node (NIC sharing)
    links: tuple[Link, ...]  # inter-site links a ring over the group crosses
    count: int  # how many groups of this kind run at once
    # inside a site: how many levels of its domains (racks, zones...) the group spans, 0 for
    # nodes of one innermost domain (or a site without domains)
    tier: int = 0


@dataclass(frozen=True)
class Placement:
    """Group shapes of one layout on one cluster."""

    order: str
    tp: GroupShape
    cp: GroupShape
    pp_boundaries: tuple[tuple[int, Link | None], ...]  # (level, link) per stage boundary
    pp_wrap: tuple[int, Link | None]  # last stage -> first (interleaved chunks pass it)
    pp_count: int
    pp_tiers: tuple[int, ...]  # domain tier of each boundary, then of the wrap
    dp: GroupShape  # the whole data-parallel (x context-parallel) group
    instance: GroupShape  # one distributed-optimizer instance's share of it
    cross: GroupShape  # the group across instances (same position in each)
    pp_crosses_sites: bool
    # MoE layers' groups (Megatron's expert rank generator: ETP, EP, EDP and the shared PP in
    # the same order string); without EP and with ETP = TP, the TP and DP groups
    ep: GroupShape | None = None
    etp: GroupShape | None = None
    edp: GroupShape | None = None


class Topology:
    """Site and node of every rank of a cluster, plus cached placements.

    ``site_of`` and ``node_of`` hold 4 bytes a rank (at most ``MAX_GPUS`` ranks: 1 MiB each).
    A kind of group is worked out once per pattern (which of its dimensions vary, and how far,
    after merging neighbours: TP x CP x DP blocks are one pattern whatever the split) with array
    operations over the ranks, so the work grows with the GPUs times the patterns a search
    meets, and the memory with the GPUs only.
    """

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        gpus = [site.gpus for site in cluster.sites]
        per_node = [site.gpus_per_node for site in cluster.sites]
        self.site_of = np.repeat(np.arange(len(gpus), dtype=np.int32), gpus)
        node_sizes = np.repeat(np.array(per_node, dtype=np.int64), [s.nodes for s in cluster.sites])
        self.node_of = np.repeat(np.arange(len(node_sizes), dtype=np.int32), node_sizes)
        self.world = int(self.site_of.size)
        self._names = [site.name for site in cluster.sites]
        self._per_node = per_node
        # domain of every rank at each level of the sites' racks/zones (a site with fewer levels
        # is one domain at the others), numbered apart across sites
        depth = max((len(site.domains) for site in cluster.sites), default=0)
        first_node = np.cumsum([0] + [site.nodes for site in cluster.sites])[:-1]
        in_site = self.node_of - first_node[self.site_of]
        self.domain_of: list[np.ndarray] = []
        for level in range(depth):
            size = np.array(
                [
                    site.domains[level].nodes if level < len(site.domains) else site.nodes
                    for site in cluster.sites
                ],
                dtype=np.int64,
            )
            count = np.array([site.nodes for site in cluster.sites], dtype=np.int64) // size
            offset = np.cumsum(np.concatenate(([0], count)))[:-1]
            self.domain_of.append(
                (offset[self.site_of] + in_site // size[self.site_of]).astype(np.int32)
            )
        del in_site
        self._placements: dict[tuple, Placement | str] = {}
        self._memo: dict[tuple, object] = {}
        self.computed = 0  # placements worked out (a measure of the search's work)

    def placement(
        self,
        tp: int,
        cp: int,
        pp: int,
        dp: int,
        instances: int,
        order: str,
        ep: int = 1,
        etp: int = 1,
    ) -> Placement:
        """Group shapes for a layout (cached: they do not depend on batch or recomputation)."""
        key = (tp, cp, pp, dp, instances, order, ep, etp)
        hit = self._placements.get(key)
        if hit is None:
            try:
                hit = self._compute(tp, cp, pp, dp, instances, order, ep, etp)
            except PortingError as err:
                # a missing link: every layout of this placement is told the same, and only the
                # message is kept (the traceback would keep the rank tables of its frames alive)
                hit = str(err)
            self._placements[key] = hit
        if isinstance(hit, str):
            raise PortingError(hit)
        return hit

    def fewest_instances(self, tp: int, cp: int, pp: int, dp: int, order: str) -> int:
        """The fewest distributed-optimizer instances whose every instance (an equal contiguous
        chunk of a data-parallel group) stays inside one site.

        A chunk of ``c`` members keeps its members in one site when every place where a
        data-parallel group passes from one site to the next falls on a multiple of ``c``: the
        largest such ``c`` is the gcd of those places and the group's size.
        """
        unit, pattern = self._pattern(tp, cp, pp, dp, order, "dp-cp")

        def work() -> int:
            rows = _rows(pattern)
            sites = self._tables(unit)[0][rows]
            d = rows.shape[1]
            changes = np.flatnonzero((sites[:, 1:] != sites[:, :-1]).any(axis=0)) + 1
            return d // math.gcd(d, *changes.tolist())

        return self._once(("instances", unit, pattern), work)

    def _once(self, key: tuple, work):
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = work()
        return hit

    def _unit(self, tp: int) -> int:
        # A TP group is tp consecutive ranks, and where tp divides every node (as the search
        # requires) nodes and sites begin on multiples of it: every other group then takes one
        # rank of each block of tp, all blocks alike, so the groups are worked out on the blocks.
        return self._once(
            ("unit", tp), lambda: tp if all(g % tp == 0 for g in self._per_node) else 1
        )

    def _pattern(
        self, tp: int, cp: int, pp: int, dp: int, order: str, token: str
    ) -> tuple[int, tuple[tuple[bool, int], ...]]:
        """(ranks per unit, the token's groups over the units as :func:`_merged_dims`)."""
        unit = 1 if token == "tp" else self._unit(tp)
        sizes = {"tp": tp // unit, "cp": cp, "ep": 1, "pp": pp, "dp": dp}
        return unit, _merged_dims(sizes, order, token)

    def _group_shape(
        self, unit: int, pattern: tuple, instances: int = 1, part: str = ""
    ) -> GroupShape:
        """The shape of the groups ``pattern`` describes, or of the ``part`` ("instance",
        "cross") of them that ``instances`` distributed-optimizer instances make."""

        def work() -> GroupShape:
            rows = _rows(pattern)
            if part:
                groups, size = rows.shape
                chunk = size // instances
                # Megatron cuts each data-parallel group into equal contiguous instances; the
                # cross-instance groups take the same place in each
                if part == "instance":
                    rows = rows.reshape(groups * instances, chunk)
                else:
                    rows = rows.reshape(groups, instances, chunk).transpose(0, 2, 1)
                    rows = rows.reshape(groups * chunk, instances)
            return self._shape(unit, rows)

        return self._once(("shape", unit, pattern, instances, part), work)

    def _tables(self, unit: int) -> tuple[np.ndarray, np.ndarray]:
        """(site, node) of the first rank of every unit, contiguous for fast gathers."""
        if unit == 1:
            return self.site_of, self.node_of
        return self._once(
            ("tables", unit),
            lambda: (self.site_of[::unit].copy(), self.node_of[::unit].copy()),
        )

    def _domain_tables(self, unit: int) -> list[np.ndarray]:
        if unit == 1:
            return self.domain_of
        return self._once(("domains", unit), lambda: [d[::unit].copy() for d in self.domain_of])

    def _tier(self, unit: int, rows: np.ndarray) -> int:
        """Levels of the sites' domains the groups in ``rows`` span (their widest)."""
        tables = self._domain_tables(unit)
        for level in range(len(tables) - 1, -1, -1):
            dom = tables[level][rows]
            if (dom[:, 1:] != dom[:, :-1]).any():
                return level + 1
        return 0

    def _shape(self, unit: int, rows: np.ndarray) -> GroupShape:
        count, size = rows.shape
        site_of, node_of = self._tables(unit)
        nodes = node_of[rows]
        moves = nodes[:, 1:] != nodes[:, :-1]
        if not moves.any():
            return GroupShape(size, NODE, size, (), count * unit)
        tier = self._tier(unit, rows)
        # members ascend, so a group's members on one node are consecutive: a run
        first = np.ones((count, size), dtype=bool)
        first[:, 1:] = moves
        starts = np.flatnonzero(first)
        per_node = int(np.diff(starts, append=count * size).min())
        del nodes, moves, first, starts
        sites = site_of[rows]
        # ring neighbours: each member and the next, and the last and the first past two
        crossing = np.zeros((count, size), dtype=bool)
        crossing[:, :-1] = sites[:, 1:] != sites[:, :-1]
        if size > 2:
            crossing[:, -1] = sites[:, -1] != sites[:, 0]
        at = np.flatnonzero(crossing)
        if not at.size:
            return GroupShape(size, SITE, per_node, (), count * unit, tier)
        row, col = np.divmod(at, size)
        a, b = sites[row, col], sites[row, (col + 1) % size]
        n = len(self._names)
        code = np.minimum(a, b).astype(np.int64) * n + np.maximum(a, b)
        # each pair of sites once, in the order the groups first cross it
        first_at = np.full(n * n, code.size, dtype=np.int64)
        np.minimum.at(first_at, code, np.arange(code.size))
        found = np.flatnonzero(first_at < code.size)
        links = tuple(
            self.cluster.link(self._names[c // n], self._names[c % n])
            for c in found[np.argsort(first_at[found])].tolist()
        )
        return GroupShape(size, WAN, per_node, links, count * unit, tier)

    def _pipeline(self, unit: int, pattern: tuple) -> tuple[tuple, tuple]:
        """(the widest level and its link between each stage and the next, the same from the
        last stage to the first) over all pipelines; the link is the first pipeline's that
        crosses there."""

        def work() -> tuple[tuple, tuple]:
            rows = _rows(pattern)
            site_of, node_of = self._tables(unit)
            # column i: stage i against the next, the last column the last stage and the first
            sites = site_of[rows]
            after = np.roll(sites, -1, axis=1)
            crossing = sites != after
            wan = crossing.any(axis=0)
            first = crossing.argmax(axis=0)
            del crossing
            nodes = node_of[rows]
            site_level = (nodes != np.roll(nodes, -1, axis=1)).any(axis=0)
            out: list[tuple[int, Link | None]] = []
            for i in range(rows.shape[1]):
                if wan[i]:
                    a, b = sites[first[i], i], after[first[i], i]
                    out.append((WAN, self.cluster.link(self._names[a], self._names[b])))
                else:
                    out.append((SITE if site_level[i] else NODE, None))
            return tuple(out[:-1]), (out[-1] if len(out) > 1 else (NODE, None))

        return self._once(("pipeline", unit, pattern), work)

    def _pipeline_tiers(self, unit: int, pattern: tuple) -> tuple[int, ...]:
        """The domain tier of each stage boundary (as :meth:`_pipeline`'s columns: the
        boundaries, then the wrap from the last stage to the first)."""

        def work() -> tuple[int, ...]:
            rows = _rows(pattern)
            tiers = [0] * rows.shape[1]
            for level, table in enumerate(self._domain_tables(unit)):
                dom = table[rows]
                differs = (dom != np.roll(dom, -1, axis=1)).any(axis=0)
                for i in np.flatnonzero(differs).tolist():
                    tiers[i] = level + 1
            if rows.shape[1] == 1:
                return (0,)
            return tuple(tiers)

        return self._once(("pipeline tiers", unit, pattern), work)

    def _expert_shape(self, etp: int, ep: int, edp: int, pp: int, order: str, token: str):
        """The shape of one kind of the MoE layers' groups: Megatron builds them with its rank
        generator over ETP x EP x EDP x PP (CP folded into EDP) in the same order string."""
        sizes = {"tp": etp, "cp": 1, "ep": ep, "pp": pp, "dp": edp}
        return self._group_shape(1, _merged_dims(sizes, order, token))

    def _compute(
        self,
        tp: int,
        cp: int,
        pp: int,
        dp: int,
        instances: int,
        order: str,
        ep: int = 1,
        etp: int = 1,
    ) -> Placement:
        self.computed += 1

        if self._unit(tp) == tp:
            tp_shape = GroupShape(tp, NODE, tp, (), self.world // tp)
        else:
            tp_shape = self._group_shape(*self._pattern(tp, cp, pp, dp, order, "tp"))
        pp_pattern = self._pattern(tp, cp, pp, dp, order, "pp")
        boundaries, wrap = self._pipeline(*pp_pattern)
        unit, dp_pattern = self._pattern(tp, cp, pp, dp, order, "dp-cp")
        dp_shape = self._group_shape(unit, dp_pattern)
        if ep == 1 and etp == tp:
            # the expert grid is the attention grid: experts sharded as the dense layers
            experts = {"etp": tp_shape, "edp": dp_shape}
        else:
            edp = tp * cp * dp // (ep * etp)
            experts = {
                name: self._expert_shape(etp, ep, edp, pp, order, token)
                for name, token in (("ep", "ep"), ("etp", "tp"), ("edp", "dp"))
            }
        return Placement(
            order=order,
            tp=tp_shape,
            cp=self._group_shape(*self._pattern(tp, cp, pp, dp, order, "cp")),
            pp_boundaries=boundaries,
            pp_wrap=wrap,
            pp_count=self.world // pp,
            pp_tiers=self._pipeline_tiers(*pp_pattern),
            dp=dp_shape,
            instance=self._group_shape(unit, dp_pattern, instances, "instance"),
            cross=self._group_shape(unit, dp_pattern, instances, "cross"),
            pp_crosses_sites=any(lv == WAN for lv, _ in boundaries),
            **experts,
        )


def _merged_dims(sizes: dict[str, int], order: str, token: str) -> tuple[tuple[bool, int], ...]:
    """The dimensions of ``order`` (fastest first) as (in the token, size), neighbours on the
    same side merged and size-1 ones left out: all that decides the groups, so that layouts
    whose groups are the same share one pattern."""
    inner = set(token.split("-"))
    out: list[tuple[bool, int]] = []
    for d in order.split("-"):
        if sizes[d] == 1:
            continue
        inside = d in inner
        if out and out[-1][0] == inside:
            out[-1] = (inside, out[-1][1] * sizes[d])
        else:
            out.append((inside, sizes[d]))
    return tuple(out)


def _rows(dims: tuple[tuple[bool, int], ...]) -> np.ndarray:
    """Every group of merged dimensions as one row each, in Megatron's order.

    A group holds the ranks that differ only in the token's dimensions, its members with the
    faster of those varying faster, and the groups come with the other dimensions varying the
    same way (``RankGenerator.get_ranks``).
    """
    members = np.zeros(1, dtype=np.int64)
    bases = np.zeros(1, dtype=np.int64)
    stride = 1
    for inside, size in dims:
        step = np.arange(size, dtype=np.int64)[:, None] * stride
        if inside:
            members = (step + members).ravel()
        else:
            bases = (step + bases).ravel()
        stride *= size
    return bases[:, None] + members[None, :]


def rank_groups(world: int, sizes: dict[str, int], order: str, token: str) -> list[list[int]]:
    """Every group of the dimensions in ``token`` (e.g. ``"dp-cp"``) for ranks ``0..world-1``."""
    if math.prod(sizes.values()) != world:
        raise ValueError(f"sizes {sizes} do not multiply to the world size {world}")
    return _rows(_merged_dims(sizes, order, token)).tolist()
