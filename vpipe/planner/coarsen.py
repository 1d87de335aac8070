"""Coarsening for the layer partition (vPipe Alg. 3, step 1): a few coarse nodes per stage.

Coarsening takes O(n + E). Layers are ordered by invoke time. Edges between consecutive
layers are backbone edges; an edge whose ends are further apart in time than a stage's
mean time is a sparse (long skip) edge and stays an edge of the coarse graph; the rest
are subgraph edges, and no coarse boundary may cut through the layers they span, so a
block's internal branches stay together. Deviations from the paper, both because a
coarse node must stay small against a stage for any bisection to balance: a node holds
between a quarter and one ``1 / GRANULARITY`` of a mean stage (at most two), and where
skip edges chain every block to the next (AmoebaNet's cells read the cell before the
previous one, so no boundary is free of subgraph edges) boundaries carrying no more
bytes than any within half a node ("valleys") are allowed too; among the allowed
boundaries in a node's weight window the cheapest wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vpipe.planner.cost_model import StageCosts

__all__ = ["GRANULARITY", "CoarseGraph", "coarsen"]

GRANULARITY = 8  # coarse nodes per mean stage, at least
_EARLY_CUT = 0.8  # coarsening: a node may end early at a boundary this much cheaper than its choice


@dataclass(frozen=True)
class CoarseGraph:
    """Coarse node ``g`` holds positions ``[bounds[g], bounds[g + 1])``."""

    bounds: np.ndarray
    backbone_edges: int
    subgraph_edges: int
    sparse_edges: int
    coarse_edges: int

    @property
    def num_nodes(self) -> int:
        return len(self.bounds) - 1


def coarsen(costs: StageCosts, num_stages: int) -> CoarseGraph:
    """One-step coarsening by invoke time (Alg. 3, lines 7-21)."""
    profile, n = costs.profile, costs.n
    invoke = costs.compute_prefix  # invoke time of the layer at each position
    mean = invoke[-1] / num_stages
    cap = mean / GRANULARITY
    src, dst = profile.edge_src, profile.edge_dst
    span = invoke[dst] - invoke[src]
    is_backbone = dst == src + 1
    is_sparse = ~is_backbone & (span > mean)
    is_subgraph = ~is_backbone & ~is_sparse
    cover = np.zeros(n + 2, dtype=np.int64)
    np.add.at(cover, src[is_subgraph] + 1, 1)  # boundaries src+1 .. dst lie inside the subgraph
    np.add.at(cover, dst[is_subgraph] + 1, -1)
    inside = np.cumsum(cover)[: n + 1] > 0
    free = np.flatnonzero(~inside[1:n]) + 1  # boundaries no subgraph edge crosses
    allowed = np.union1d(free, _valleys(costs, cap / 2))
    bounds = _select_bounds(costs, allowed, cap)
    group_of = np.searchsorted(bounds, np.arange(n), side="right") - 1
    g_src, g_dst = group_of[src], group_of[dst]
    crossing = g_src != g_dst
    coarse_edges = int(np.unique(g_src[crossing] * (n + 1) + g_dst[crossing]).size)
    return CoarseGraph(bounds, int(is_backbone.sum()), int(is_subgraph.sum()), int(is_sparse.sum()),
                       coarse_edges)


def _valleys(costs: StageCosts, reach: float) -> np.ndarray:
    """Boundaries carrying no more bytes than any other within ``reach`` compute-seconds:
    where a block ends even when skip edges make every boundary cross some edge."""
    prefix, cut, n = costs.compute_prefix, costs.cut, costs.n
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    pos = np.arange(1, n)
    lo = np.clip(np.searchsorted(prefix, prefix[pos] - reach, side="left"), 1, n - 1)
    hi = np.clip(np.searchsorted(prefix, prefix[pos] + reach, side="right") - 1, 1, n - 1)
    return pos[cut[pos] <= _range_min(cut, lo, hi)]


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``min(values[lo[t]:hi[t] + 1])`` for every t, from a sparse table."""
    table = [values]
    width = 1
    while 2 * width <= values.size:
        prev = table[-1]
        table.append(np.minimum(prev[:-width], prev[width:]))
        width *= 2
    length = hi - lo + 1
    level = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
    out = np.empty(lo.size)
    for k in np.unique(level):
        sel = level == k
        row = table[k]
        out[sel] = np.minimum(row[lo[sel]], row[hi[sel] - (1 << k) + 1])
    return out


def _select_bounds(costs: StageCosts, allowed: np.ndarray, cap: float) -> np.ndarray:
    """Coarse node boundaries: from each start, the cheapest allowed boundary that leaves the
    node between a quarter and all of ``cap``, else the next allowed one if the node stays
    under twice ``cap``; a block heavier than that with no allowed boundary inside is split
    at the cheapest plain boundary that fills the node half to full. An allowed boundary
    nearer than a quarter wins when it carries at most ``_EARLY_CUT`` of that choice's bytes:
    without it a run of equal, heavy boundaries decides where nodes end and can step over
    the cheap boundary that ends a block, which then no coarse partition can use."""
    prefix, cut, n = costs.compute_prefix, costs.cut, costs.n
    at = prefix[allowed]
    bounds, start = [0], 0
    while prefix[n] - prefix[start] > cap and start < n - 1:
        base = prefix[start]
        first = int(np.searchsorted(allowed, start, side="right"))
        i_lo = max(first, int(np.searchsorted(at, base + cap / 4, side="left")))
        i_hi = int(np.searchsorted(at, base + cap, side="right"))
        beyond = int(np.searchsorted(at, base + 2 * cap, side="right"))
        if i_lo < i_hi:
            window = allowed[i_lo:i_hi]
        elif i_hi < beyond:  # the next natural boundary makes a node a little heavy: still take it
            window = allowed[i_hi:i_hi + 1]
        else:
            lo = max(start + 1, int(np.searchsorted(prefix, base + cap / 2, side="left")))
            hi = max(lo, min(n - 1, int(np.searchsorted(prefix, base + cap, side="right")) - 1))
            window = np.arange(lo, hi + 1)
        choice = _latest_cheapest(window, cut)
        early = allowed[first:max(first, min(i_lo, i_hi))]  # allowed, but would leave a node under cap / 4
        if early.size:
            light = _latest_cheapest(early, cut)
            if cut[light] <= _EARLY_CUT * cut[choice]:
                # much cheaper than anything in the window: a small node, but a boundary that a
                # stage may well want (a block's end just after the previous choice)
                choice = light
        start = choice
        bounds.append(start)
    bounds.append(n)
    return np.unique(np.array(bounds, dtype=np.int64))


def _latest_cheapest(positions: np.ndarray, cut: np.ndarray) -> int:
    return int(positions[len(positions) - 1 - np.argmin(cut[positions][::-1])])
