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
from functools import lru_cache

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


@dataclass(frozen=True)
class Placement:
    """Group shapes of one layout on one cluster."""

    order: str
    tp: GroupShape
    cp: GroupShape
    pp_boundaries: tuple[tuple[int, Link | None], ...]  # (level, link) per stage boundary
    pp_wrap: tuple[int, Link | None]  # last stage -> first (interleaved chunks pass it)
    pp_count: int
    dp: GroupShape  # the whole data-parallel (x context-parallel) group
    instance: GroupShape  # one distributed-optimizer instance's share of it
    cross: GroupShape  # the group across instances (same position in each)
    pp_crosses_sites: bool


class Topology:
    """Site and node of every rank of a cluster, plus cached placements."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        site_of: list[int] = []
        node_of: list[int] = []
        node = 0
        for si, site in enumerate(cluster.sites):
            for _ in range(site.nodes):
                site_of.extend([si] * site.gpus_per_node)
                node_of.extend([node] * site.gpus_per_node)
                node += 1
        self.site_of = site_of
        self.node_of = node_of
        self._placements: dict[tuple, Placement] = {}

    def placement(
        self, tp: int, cp: int, pp: int, dp: int, instances: int, order: str
    ) -> Placement:
        """Group shapes for a layout (cached: they do not depend on batch or recomputation)."""
        key = (tp, cp, pp, dp, instances, order)
        hit = self._placements.get(key)
        if hit is None:
            hit = self._compute(tp, cp, pp, dp, instances, order)
            self._placements[key] = hit
        return hit

    def _level(self, a: int, b: int) -> int:
        if self.node_of[a] == self.node_of[b]:
            return NODE
        if self.site_of[a] == self.site_of[b]:
            return SITE
        return WAN

    def _shape(self, groups: list[list[int]]) -> GroupShape:
        level = NODE
        per_node = 1 << 30
        links: dict[tuple[str, str], Link] = {}
        sites = self.cluster.sites
        for g in groups:
            counts: dict[int, int] = {}
            for r in g:
                counts[self.node_of[r]] = counts.get(self.node_of[r], 0) + 1
            per_node = min(per_node, min(counts.values()))
            if len(counts) > 1:
                level = max(level, SITE)
            n = len(g)
            for i in range(n if n > 2 else n - 1):
                a, b = g[i], g[(i + 1) % n]
                sa, sb = self.site_of[a], self.site_of[b]
                if sa != sb:
                    level = WAN
                    key = tuple(sorted((sites[sa].name, sites[sb].name)))
                    if key not in links:
                        links[key] = self.cluster.link(*key)
        size = len(groups[0]) if groups else 1
        return GroupShape(
            size, level, per_node if groups else 1, tuple(links.values()), len(groups)
        )

    def _boundary(self, groups: list[list[int]], i: int, j: int) -> tuple[int, Link | None]:
        """Widest level between stages ``i`` and ``j`` over all pipelines, and its link."""
        worst, link = NODE, None
        for g in groups:
            lv = self._level(g[i], g[j])
            if lv > worst:
                worst = lv
            if lv == WAN and link is None:
                a = self.cluster.sites[self.site_of[g[i]]].name
                b = self.cluster.sites[self.site_of[g[j]]].name
                link = self.cluster.link(a, b)
        return worst, link

    def _compute(self, tp: int, cp: int, pp: int, dp: int, instances: int, order: str) -> Placement:
        world = len(self.site_of)
        sizes = {"tp": tp, "cp": cp, "ep": 1, "pp": pp, "dp": dp}
        tp_groups = rank_groups(world, sizes, order, "tp")
        cp_groups = rank_groups(world, sizes, order, "cp")
        pp_groups = rank_groups(world, sizes, order, "pp")
        dp_groups = rank_groups(world, sizes, order, "dp-cp")
        chunk = (dp * cp) // instances
        inst_groups = [g[i * chunk : (i + 1) * chunk] for g in dp_groups for i in range(instances)]
        cross_groups = [g[j::chunk] for g in dp_groups for j in range(chunk)]
        boundaries = [self._boundary(pp_groups, i, i + 1) for i in range(pp - 1)]
        wrap = self._boundary(pp_groups, pp - 1, 0) if pp > 1 else (NODE, None)
        crosses = any(lv == WAN for lv, _ in boundaries)
        return Placement(
            order=order,
            tp=self._shape(tp_groups),
            cp=self._shape(cp_groups),
            pp_boundaries=tuple(boundaries),
            pp_wrap=wrap,
            pp_count=len(pp_groups),
            dp=self._shape(dp_groups),
            instance=self._shape(inst_groups),
            cross=self._shape(cross_groups),
            pp_crosses_sites=crosses,
        )


@lru_cache(maxsize=256)
def _groups_cached(world: int, sizes: tuple[tuple[str, int], ...], order: str, token: str):
    dims = order.split("-")
    size_of = dict(sizes)
    strides = {}
    stride = 1
    for d in dims:
        strides[d] = stride
        stride *= size_of[d]
    inner = token.split("-")
    # Members of a group vary the token's dimensions, fastest first in the order's sense.
    inner_sorted = [d for d in dims if d in inner]
    outer = [d for d in dims if d not in inner]
    inner_offsets = [0]
    for d in inner_sorted:
        inner_offsets = [o + i * strides[d] for i in range(size_of[d]) for o in inner_offsets]
    outer_offsets = [0]
    for d in outer:
        outer_offsets = [o + i * strides[d] for i in range(size_of[d]) for o in outer_offsets]
    return tuple(tuple(base + off for off in inner_offsets) for base in outer_offsets)


def rank_groups(world: int, sizes: dict[str, int], order: str, token: str) -> list[list[int]]:
    """Every group of the dimensions in ``token`` (e.g. ``"dp-cp"``) for ranks ``0..world-1``."""
    if math.prod(sizes.values()) != world:
        raise ValueError(f"sizes {sizes} do not multiply to the world size {world}")
    key = tuple(sorted(sizes.items()))
    return [list(g) for g in _groups_cached(world, key, order, token)]
