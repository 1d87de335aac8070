"""Layer partition (vPipe Alg. 3): coarsen, partition the coarse chain, uncoarsen, refine.

Every result is a valid pipeline: a stage is a contiguous run of the execution order, so
no edge can go from a later stage to an earlier one (general graph partitioners, plain KL
and METIS alike, produce cyclic stage graphs on real DNN graphs). The cost of a partition
is the slowest stage's time first (:class:`StageCosts`, boundary transfers included) and
the boundary bytes second.

1. *Coarsen* (O(n + E)). Layers are ordered by invoke time. Edges between consecutive
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
2. *Partition* the coarse graph. Its nodes are in execution order and every stage is a
   contiguous run of them, so it is a chain whose optimal partition (min-max time, then
   fewest bytes, memory limits included) is a DP (:mod:`vpipe.planner.exact` on a
   :class:`~vpipe.planner.cost_model.CoarseCosts` view). Its work grows with the square of
   the coarse nodes, a few per stage whatever the graph's size, so it stays about 0.1 s up
   to 128 stages (coarse nodes twice as large would halve that, but gave ten times as many
   results more than 2 % above the optimum on random chains); when
   :func:`~vpipe.planner.exact.dp_cells` says the DP on every boundary is as cheap, that
   runs instead and its optimum is the result. Deviation from the
   paper, which bisects recursively with Kernighan-Lin: bisection decides the stage count of
   each half from estimates, and where every possible cut is heavy (AmoebaNet's first cells)
   those estimates give the cheap tail too many stages, 25 % above the optimum at 32-128
   stages. The KL bisection remains for coarse chains too big for the DP (far beyond 128
   stages): ``p`` stages split into ``p // 2`` and the rest, at a
   coarse boundary chosen by Kernighan-Lin: moves carry the boundary vertex across, a
   move's gain is the change in (memory overflow, imbalance beyond a 3 % tolerance,
   boundary bytes), and each pass keeps its best prefix of moves. A side's load counts its
   inner boundaries' transfers, priced at its cheapest coarse boundaries. With a single
   contiguous boundary only the two vertices next to it are movable and a moved vertex is
   locked, so a pass slides the boundary in one direction; a pass's moves are evaluated
   together with numpy.
3. *Uncoarsen*: coarse boundaries are positions of the full graph.
4. *Refine* the boundaries at full resolution. Moving one boundary changes two stages, so
   boundaries refined one at a time stall at local peaks (three stages 10, 12, 10 with a
   heaviest layer of 2 cannot improve pairwise), and shifting work between distant stages
   needs every boundary between them to move. So each boundary gets a candidate set, every
   position within a fifth of a mean stage of it plus the nearest coarse boundaries and
   the graph's cheapest boundaries and the positions next to its neighbours (all positions
   when the graph is small enough), and one Viterbi pass over the candidate sets picks the
   jointly best positions: min-max time, then the fewest bytes at that time. The sets are
   re-centred on the result and the pass repeated while it improves (in the first rounds by
   anything, later by any time or by more than ``_MIN_GAIN`` of the bytes). Its work is
   bounded by ``_CELLS`` (start, end) pairs per pass, all of a pass's times computed in one
   numpy call. When swaps are planned
   a stage's time is ``max(compute, copy)``, which the bisection's per-side estimates
   cannot see, so after a bisection the refinement also starts from the greedy probe's
   partition and keeps the better result (the DPs price it exactly).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from vpipe.planner.cost_model import CoarseCosts, StageCosts
from vpipe.planner.exact import (CommBytes, MemoryMode, Partition, dp_cells, greedy_partition, min_bottleneck,
                                 min_secondary)

__all__ = ["GRANULARITY", "CoarseGraph", "coarsen", "chain_dp", "kl_partition", "recursive_bisection", "refine",
           "is_valid_pipeline"]

GRANULARITY = 8  # coarse nodes per mean stage, at least
_EARLY_CUT = 0.8  # coarsening: a node may end early at a boundary this much cheaper than its choice
_BALANCE_TOL = 0.03  # bisection: imbalance below this is free, so boundary bytes decide
_CELLS = 600_000  # refinement: (stage start, stage end) pairs examined per Viterbi pass
_BAND = 0.2  # ... every position within +- this fraction of a mean stage's compute,
_MIN_BAND = 4  # ... at least this many either side, then the nearest coarse boundaries
_ROUNDS = 6
_MIN_GAIN = 0.01  # ... while a round gains more than this fraction of the boundary bytes (or any time),
_SURE_ROUNDS = 2  # ... or while it is one of the first rounds (a time gain can follow a round of bytes)
_EXACT_CELLS = 8_000_000  # the partition step: the exact DP on every boundary up to this estimated work,
_COARSE_CELLS = 40_000_000  # ... on the coarse boundaries up to this, else KL bisection (see kl_partition)
_REL_TOL = 1e-9


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
    return CoarseGraph(bounds, int(is_backbone.sum()), int(is_subgraph.sum()), int(is_sparse.sum()), coarse_edges)


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


# --------------------------------------------------------------------- KL bisection
def _cheapest_sums(values: np.ndarray, count: int) -> np.ndarray:
    """``out[t]`` = sum of the ``count`` smallest of ``values[:t]`` (inf if there are fewer)."""
    out = np.full(values.size + 1, np.inf)
    if count == 0:
        out[:] = 0.0
        return out
    heap: list[float] = []  # the smallest ``count`` so far, negated (a max-heap)
    total = 0.0
    for t, v in enumerate(values):
        if len(heap) < count:
            heapq.heappush(heap, -v)
            total += v
        elif v < -heap[0]:
            total += v + heapq.heappushpop(heap, -v)
        if len(heap) == count:
            out[t + 1] = total
    return out


def _kl_cut(costs: StageCosts, candidates: np.ndarray, lo: int, hi: int, left_stages: int,
            right_stages: int, first_stage: int, budgets: np.ndarray, memory: MemoryMode) -> int:
    """Kernighan-Lin on one contiguous boundary: best prefix of boundary-vertex moves.

    A move's gain is the change in (memory overflow, imbalance beyond the tolerance,
    boundary bytes), compared in that order. A side's per-stage load counts its busy time
    (compute, or copy-link time where swaps dominate), its two outer boundaries, and its
    inner boundaries (each received twice: activations forward, gradients backward) priced
    at the cheapest coarse boundaries on that side, where the recursion will put them."""
    c_pre, x_pre, comm = costs.compute_prefix, costs.swap_prefix, costs.comm
    c_comm = comm[candidates]
    inner_left = _cheapest_sums(c_comm, left_stages - 1)[:-1]  # boundaries strictly left of each
    inner_right = _cheapest_sums(c_comm[::-1], right_stages - 1)[:-1][::-1]
    busy_left = np.maximum(c_pre[candidates] - c_pre[lo], x_pre[candidates] - x_pre[lo])
    busy_right = np.maximum(c_pre[hi] - c_pre[candidates], x_pre[hi] - x_pre[candidates])
    left = busy_left + comm[lo] + c_comm + 2.0 * inner_left
    right = busy_right + c_comm + comm[hi] + 2.0 * inner_right
    estimate = np.maximum(left / left_stages, right / right_stages)
    if not np.isfinite(estimate).any():  # too few coarse boundaries for the inner cuts
        estimate = np.maximum(busy_left / left_stages, busy_right / right_stages)
    penalty = np.maximum(0.0, estimate - (1.0 + _BALANCE_TOL) * estimate.min())
    overflow = _memory_overflow(costs, candidates, lo, hi, left_stages, right_stages, first_stage, budgets, memory)
    cut_bytes = costs.cut[candidates]
    keys = (overflow, penalty, cut_bytes)
    # start at the best-balanced boundary, then let passes move it while they gain
    current = int(np.lexsort((estimate, overflow))[0])
    while True:
        best = current
        for direction in (-1, 1):
            moves = np.arange(current + direction, -1 if direction < 0 else len(candidates), direction)
            if moves.size == 0:
                continue
            # the best prefix of this pass ends at its best move
            top = int(moves[np.lexsort(tuple(k[moves] for k in reversed(keys)))[0]])
            if tuple(k[top] for k in keys) < tuple(k[best] for k in keys):
                best = top
        if best == current:
            return int(candidates[current])
        current = best


def _memory_overflow(costs: StageCosts, candidates: np.ndarray, lo: int, hi: int, left_stages: int,
                     right_stages: int, first_stage: int, budgets: np.ndarray, memory: MemoryMode) -> np.ndarray:
    """How far each side's average stage would exceed its tightest budget (0 when it fits)."""
    out = np.zeros(candidates.size)
    sides = ((first_stage, left_stages, lo, candidates), (first_stage + left_stages, right_stages, candidates, hi))
    for side_first, count, start, end in sides:
        limit = float(budgets[side_first:side_first + count].min())
        if np.isfinite(limit):
            prefix = costs.memory_prefix(side_first, memory == "best_case")  # its first stage holds most
            out = out + np.maximum(0.0, (prefix[end] - prefix[start]) / count - limit)
    return out


def recursive_bisection(costs: StageCosts, coarse: CoarseGraph, num_stages: int,
                        budgets: np.ndarray | None = None, memory: MemoryMode = "fixed") -> list[int]:
    """Alg. 3's ``partition``: recursive KL bisection over the coarse boundaries."""
    budgets = np.full(num_stages, np.inf) if budgets is None else budgets
    cuts: list[int] = []

    def split(lo: int, hi: int, first_stage: int, stages: int) -> None:
        if stages == 1:
            return
        left_stages = stages // 2
        right_stages = stages - left_stages
        inner = coarse.bounds[(coarse.bounds >= lo + left_stages) & (coarse.bounds <= hi - right_stages)]
        if inner.size == 0:  # too few coarse nodes here: fall back to full resolution
            inner = np.arange(lo + left_stages, hi - right_stages + 1)
        cut = _kl_cut(costs, inner, lo, hi, left_stages, right_stages, first_stage, budgets, memory)
        split(lo, cut, first_stage, left_stages)
        cuts.append(cut)
        split(cut, hi, first_stage + left_stages, right_stages)

    split(0, costs.n, 0, num_stages)
    return cuts


# --------------------------------------------------------------------- refinement
def _candidates(costs: StageCosts, cuts: np.ndarray, count: int, fine: float, far: np.ndarray) -> np.ndarray:
    """Where each boundary may move in one round: one row of about ``count`` positions per cut
    (repeats allowed). Every position within ``fine`` seconds of busy time (compute plus
    copy-link time) of the cut, at least ``_MIN_BAND`` either side, then the ``far`` positions
    (coarse boundaries, the graph's cheapest boundaries) nearest to it on each side, so a round
    can make long moves between the places where cutting is cheap; and the positions next to
    its neighbours, so that shifting every boundary by one slot is a single move, which is how
    work travels between distant stages. All positions when there are no more than ``count``."""
    prefix, n = costs.compute_prefix + costs.swap_prefix, costs.n  # distance in busy time
    if count >= n - 1:
        return np.broadcast_to(np.arange(1, n), (cuts.size, n - 1))
    here = prefix[cuts]
    half = max(_MIN_BAND, count // 4)
    lo = np.searchsorted(prefix, here - fine, side="left")
    hi = np.searchsorted(prefix, here + fine, side="right") - 1
    lo = np.maximum.reduce([np.ones_like(cuts), np.minimum(lo, cuts - _MIN_BAND), cuts - half])
    hi = np.minimum.reduce([np.full_like(cuts, n - 1), np.maximum(hi, cuts + _MIN_BAND), cuts + half])
    near = np.minimum(lo[:, None] + np.arange(2 * half + 1), hi[:, None])
    columns = [near]
    room = count - near.shape[1]
    if far.size and room > 0:  # the ``room`` far positions outside the band nearest to the cut
        left = np.searchsorted(far, lo)[:, None] - 1 - np.arange(room)
        right = np.searchsorted(far, hi, side="right")[:, None] + np.arange(room)
        around = np.concatenate([left, right], axis=1)
        outside = (around >= 0) & (around < far.size)
        picks = far[np.clip(around, 0, far.size - 1)]
        distance = np.where(outside, np.abs(prefix[picks] - here[:, None]), np.inf)
        nearest = np.argpartition(distance, room - 1, axis=1)[:, :room]
        columns.append(np.where(np.take_along_axis(outside, nearest, axis=1),
                                np.take_along_axis(picks, nearest, axis=1), cuts[:, None]))
    reach = np.arange(-2 * _MIN_BAND, 2 * _MIN_BAND + 1)
    before = np.concatenate([cuts[:1], cuts[:-1]])
    after = np.concatenate([cuts[1:], cuts[-1:]])
    columns += [before[:, None] + reach, after[:, None] + reach]
    return np.clip(np.concatenate(columns, axis=1), 1, n - 1)


class _Bands:
    """Candidate positions for every boundary and the stage times between consecutive bands."""

    def __init__(self, costs: StageCosts, bands: np.ndarray, budgets: np.ndarray, memory: MemoryMode) -> None:
        n = costs.n
        q, width = bands.shape
        self.bands = bands
        # stage k runs from a position of band k - 1 to one of band k; the first starts at 0 and
        # the last ends at n (their rows repeat it, and the Viterbi uses one of them)
        starts = np.concatenate([np.zeros((1, width), dtype=np.int64), bands])[:, :, None]
        ends = np.concatenate([bands, np.full((1, width), n, dtype=np.int64)])[:, None, :]
        self.times = np.asarray(costs.time(starts, ends), dtype=float)  # (stage, start, end)
        ok = starts < ends
        finite = np.flatnonzero(np.isfinite(budgets))
        if finite.size:
            mem = np.stack([costs.memory_prefix(int(k), memory == "best_case") for k in finite])
            k_of = np.searchsorted(finite, np.arange(q + 1))
            rows = np.minimum(k_of, finite.size - 1)
            limited = np.isfinite(budgets)[:, None, None]
            need = mem[rows[:, None, None], ends] - mem[rows[:, None, None], starts]
            ok &= ~limited | (need <= budgets[:, None, None])
        self.times[~ok] = np.inf
        self.start_bytes = costs.cut[starts[:, :, 0]]
        self.start_bytes[0] = 0.0

    def viterbi(self, limit: float | None) -> tuple[list[int], float] | None:
        """One boundary from each band: min-max time, or (given ``limit``) min bytes within it."""
        width = self.bands.shape[1]
        value = np.zeros(width)
        value[1:] = np.inf  # one start for the first stage
        parents: list[np.ndarray] = []
        slack = None if limit is None else limit * (1.0 + _REL_TOL) + 1e-18
        cols = np.arange(width)
        for t, start_bytes in zip(self.times, self.start_bytes):
            if slack is None:
                cand = np.maximum(value[:, None], t)
            else:
                cand = np.where(t <= slack, (value + start_bytes)[:, None], np.inf)
            arg = np.argmin(cand, axis=0)
            value = cand[arg, cols]
            parents.append(arg)
        if not np.isfinite(value[0]):
            return None
        cuts, idx = [], 0
        for k in range(len(parents) - 1, 0, -1):
            idx = int(parents[k][idx])
            cuts.append(int(self.bands[k - 1][idx]))
        cuts.reverse()
        return cuts, float(value[0])


def refine(costs: StageCosts, cuts: list[int], budgets: np.ndarray, memory: MemoryMode = "fixed",
           coarse_bounds: np.ndarray | None = None) -> list[int] | None:
    """Move the boundaries to the jointly best positions among their candidates, re-centring
    the candidates while that improves the plan. None if no choice fits the memory limits."""
    if not cuts:
        return cuts
    mean = (costs.compute_prefix[-1] + costs.swap_prefix[-1]) / (len(cuts) + 1)
    n = costs.n
    cheapest = np.argsort(costs.cut[1:n], kind="stable")[: 2 * (len(cuts) + 1)] + 1
    far = np.union1d(np.asarray(coarse_bounds if coarse_bounds is not None else [], dtype=np.int64), cheapest)
    far = far[(far >= 1) & (far <= n - 1)]
    count = max(2 * _MIN_BAND + 1, int(np.sqrt(_CELLS / (len(cuts) + 1))))
    best: tuple[float, float, list[int]] | None = None
    for done in range(_ROUNDS):
        bands = _Bands(costs, _candidates(costs, np.asarray(cuts, dtype=np.int64), count, _BAND * mean, far),
                       budgets, memory)
        found = bands.viterbi(None)
        if found is None:
            break
        lean = bands.viterbi(found[1])
        new = lean[0] if lean is not None else found[0]
        key = (float(costs.stage_times(new).max()), float(costs.comm_bytes(new)), new)
        if best is not None and key[:2] >= best[:2]:
            break  # re-centring no longer helps
        settled = (done >= _SURE_ROUNDS and best is not None and key[0] >= best[0] * (1 - _REL_TOL)
                   and key[1] >= best[1] * (1 - _MIN_GAIN))
        best = key
        if new == cuts or settled:  # the slowest stage holds and the bytes hardly move: stop
            break
        cuts = new
    return None if best is None else best[2]


def chain_dp(costs: StageCosts, positions: np.ndarray, num_stages: int, budgets: np.ndarray,
             memory: MemoryMode = "fixed") -> list[int] | None:
    """The optimal partition whose cuts all lie on ``positions`` (0 and n among them): the
    smallest slowest stage, then the fewest boundary bytes; None when none fits the memory
    limits. Stages are contiguous, so the coarse graph is a chain and its optimum is a DP."""
    view = CoarseCosts(costs, positions)
    best = min_bottleneck(view, num_stages, budgets, memory=memory)
    if best is None:
        return None
    lean = min_secondary(view, num_stages, best.bottleneck_s, CommBytes(view), budgets, memory=memory)
    return view.full_cuts((lean or best).cuts)


def kl_partition(costs: StageCosts, num_stages: int, budgets: np.ndarray | None = None, *,
                 memory: MemoryMode = "fixed") -> Partition | None:
    """Alg. 3: coarsen, partition the coarse chain, uncoarsen, refine. None when no placement
    of the boundaries it finds fits the memory limits.

    The partition step takes the cheapest of three that the graph allows: the exact DP on
    every boundary when its estimated work is small (the optimum, nothing to refine), the
    exact DP on the coarse chain's boundaries (coarsening keeps a few coarse nodes per stage
    whatever the graph's size, so this stays cheap up to about 128 stages), and beyond that
    the paper's recursive KL bisection.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"number of stages must be a positive integer, got {num_stages!r}")
    if num_stages > costs.n:
        raise ValueError(f"cannot split {costs.n} layers into {num_stages} non-empty stages")
    budgets = np.full(num_stages, np.inf) if budgets is None else np.asarray(budgets, dtype=float)
    if dp_cells(costs, num_stages) <= _EXACT_CELLS:
        cuts = chain_dp(costs, np.arange(costs.n + 1), num_stages, budgets, memory)
        return None if cuts is None else _partition_of(costs, cuts)
    coarse = coarsen(costs, num_stages)
    start = None
    if coarse.num_nodes >= num_stages and dp_cells(CoarseCosts(costs, coarse.bounds), num_stages) <= _COARSE_CELLS:
        start = chain_dp(costs, coarse.bounds, num_stages, budgets, memory)
    if start is not None:
        starts = [start]
    else:
        starts = [recursive_bisection(costs, coarse, num_stages, budgets, memory)]
        if costs.has_swaps:
            # swaps make a stage's time max(compute, copy) per stage, which the bisection's side
            # estimates cannot see: also refine from the greedy probe's partition, which prices
            # every stage exactly, and keep the better
            greedy = greedy_partition(costs, num_stages, budgets, memory)
            if greedy is not None:
                starts.append(list(greedy.cuts))
    best: Partition | None = None
    for cuts in starts:
        refined = refine(costs, cuts, budgets, memory, coarse.bounds)
        if refined is None:
            continue
        found = _partition_of(costs, refined)
        if best is None or (found.bottleneck_s, found.secondary) < (best.bottleneck_s, best.secondary):
            best = found
    return best


def _partition_of(costs: StageCosts, cuts: list[int]) -> Partition:
    return Partition(tuple(cuts), float(costs.stage_times(cuts).max()), float(costs.comm_bytes(cuts)))


def is_valid_pipeline(graph_ids_in_order: list[int], edges: list[tuple[int, int, int]],
                      stages: list[list[int]]) -> bool:
    """True when ``stages`` are non-empty contiguous runs covering the order exactly once
    and no edge runs from a later stage to an earlier one."""
    flat = [lid for stage in stages for lid in stage]
    if any(not stage for stage in stages) or flat != list(graph_ids_in_order):
        return False
    stage_of = {lid: k for k, stage in enumerate(stages) for lid in stage}
    return all(stage_of[s] <= stage_of[d] for s, d, _ in edges)
