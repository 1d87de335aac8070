"""Exact contiguous partitions of the execution order (the oracle the KL planner is measured by).

A pipeline stage is a contiguous run of the execution order, so a plan is ``p - 1`` cut
positions and the optimum can be found by dynamic programming over (stage, end position):

- :func:`min_bottleneck` minimises the slowest stage (time from :class:`StageCosts`,
  boundary communication included, so a stage's time is not monotone in its end and the
  greedy probe of the classic binary search is not exact: it only seeds the DP's band);
- :func:`min_secondary` minimises an additive per-stage cost (boundary bytes, migration
  bytes) among partitions whose every stage is within a time limit, e.g. the optimal
  bottleneck: :func:`exact_partition` chains the two.

Both honour per-stage memory limits. The DP is banded: in a partition with bottleneck
<= T every stage computes, and swaps, for <= T, so only segments that short are tried,
which makes the oracle O(n * (n/p) * p) rather than O(p * n^2) when T is near the optimum.
T starts just above a lower bound that sees boundary transfers (a DP that finds nothing
proves the optimum is higher) and widens, capped by a valid partition from the greedy
probe. :func:`dp_cells` estimates the work beforehand, so the planner can choose the DP
where it is cheap and a coarser search where it is not. What it returns and raises
(:class:`~vpipe.planner.cuts.Partition`, :class:`~vpipe.planner.cuts.InfeasibleError`) is
in :mod:`vpipe.planner.cuts`, which the normal planning path shares.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from vpipe.planner.cost_model import StageCosts
from vpipe.planner.cuts import (
    Additive,
    CommBytes,
    InfeasibleError,
    MemoryMode,
    Partition,
    check_layers_fit,
    partition_from_dp,
)

__all__ = ["min_bottleneck", "min_secondary", "exact_partition", "greedy_partition", "dp_cells"]

_BLOCK_ELEMENTS = 1 << 16  # cells per DP block: small enough to stay in cache
_FIRST_SLACK = 0.05  # the first DP's limit: this much above the lower bound
_GROWTH = 1.5  # then each limit this much above the last ...
_GREEDY_AFTER = 2.0  # ... capped by the greedy's bound once the limit passes this many lower bounds
_REL_TOL = 1e-9


# --------------------------------------------------------------------- bounds
def _lower_bound(costs: StageCosts, p: int) -> float:
    """No partition's slowest stage is faster than this.

    Two facts, both cheap: the stages together compute everything and receive every cut
    twice (the stages on both sides pay it), so the mean stage takes at least the total
    plus the ``p - 1`` cheapest cuts twice, over ``p``; and the stage holding layer ``i``
    takes at least its compute plus the cheapest way to reach it from a boundary on each
    side, which is what makes stages whose every possible cut is heavy (AmoebaNet's first
    cells) bound the result.
    """
    c, comm, n = costs.compute_prefix, costs.comm, costs.n
    inner = np.sort(comm[1:n])[: p - 1] if p > 1 else np.zeros(0)
    mean = (float(c[-1]) + 2.0 * float(inner.sum())) / p
    # min over starts s <= i of comm[s] + C[i] - C[s]
    into = np.minimum.accumulate(comm[:-1] - c[:-1]) + c[:-1]
    # min over ends e > i of C[e] - C[i+1] + comm[e]
    out = np.minimum.accumulate((c[1:] + comm[1:])[::-1])[::-1] - c[1:]
    holding = into + (c[1:] - c[:-1]) + out
    return max(mean, float(holding.max()))


def dp_cells(costs: StageCosts, num_stages: int) -> int:
    """About how many (start, end) pairs :func:`min_bottleneck`'s first DP examines.

    Every end of every stage pairs with every start within the first limit (just above the
    lower bound) of it, inside the bands the DP keeps. It ignores what the DP later finds
    unreachable, so it overestimates, cheaply (O(n + p)): the planner uses it to choose
    between the exact DP and cheaper partition steps before running anything.
    """
    n, p = costs.n, num_stages
    slack = _lower_bound(costs, p) * (1.0 + _FIRST_SLACK)
    prefix, swap = costs.compute_prefix, costs.swap_prefix
    lo = np.maximum(np.searchsorted(prefix, prefix - slack, side="left"),
                    np.searchsorted(swap, swap - slack, side="left"))
    pairs = np.concatenate([[0], np.cumsum(np.arange(n + 1) - lo)])  # pairs[j]: pairs of ends before j
    k = np.arange(p)
    ja = np.maximum(k + 1, np.searchsorted(prefix, prefix[-1] - (p - 1 - k) * slack, side="left"))
    jb = np.minimum(n - (p - 1 - k), np.searchsorted(prefix, (k + 1) * slack, side="right") - 1)
    ja[-1] = jb[-1] = n
    ok = ja <= jb
    return int(np.sum(pairs[jb[ok] + 1] - pairs[ja[ok]]))


def _upper_limit(costs: StageCosts) -> float:
    """No segment is slower than this: every layer, all swap traffic, the two worst boundaries."""
    return float(costs.compute_prefix[-1] + costs.swap_prefix[-1] + 2.0 * costs.comm.max()) + 1e-12


def _greedy_probe(costs: StageCosts, p: int, budgets: np.ndarray, memory: MemoryMode,
                  limit: float) -> list[int] | None:
    """Each stage ends as late as it can while within ``limit``: a valid partition or None."""
    n, prefix = costs.n, costs.compute_prefix
    cuts, i = [], 0
    for k in range(p):
        if k == p - 1:
            js = np.array([n])
        else:
            j_max = min(int(np.searchsorted(prefix, prefix[i] + limit, side="right")) - 1,
                        int(np.searchsorted(costs.swap_prefix, costs.swap_prefix[i] + limit,
                                            side="right")) - 1,
                        n - (p - 1 - k))
            js = np.arange(i + 1, j_max + 1)
        ok = np.asarray(costs.time(i, js)) <= limit
        if np.isfinite(budgets[k]):
            mem = costs.memory_prefix(k, memory == "best_case")
            ok &= mem[js] - mem[i] <= budgets[k]
        hits = np.flatnonzero(ok)
        if hits.size == 0:
            return None
        i = int(js[hits[-1]])
        cuts.append(i)
    return cuts[:-1]


def greedy_partition(costs: StageCosts, p: int, budgets: np.ndarray, memory: MemoryMode = "fixed"
                     ) -> Partition | None:
    """The classic heuristic: bisection on a time limit, probing each with stages that end as
    late as the limit allows. Optimal for additive costs; here (boundary transfers, swap
    exposure) only a good valid partition, or None if the probe never finds one."""
    lo, hi = _lower_bound(costs, p), _upper_limit(costs)
    best: list[int] | None = None
    best_time = np.inf
    for _ in range(40):
        if hi - lo <= 1e-4 * hi:
            break
        mid = 0.5 * (lo + hi)
        cuts = _greedy_probe(costs, p, budgets, memory, mid)
        if cuts is None:
            lo = mid
            continue
        slowest = float(costs.stage_times(cuts).max())
        if slowest < best_time:
            best, best_time = cuts, slowest
        hi = mid
    return None if best is None else Partition(tuple(best), best_time, float(costs.comm_bytes(best)))


def _upper_bound(costs: StageCosts, p: int, budgets: np.ndarray, memory: MemoryMode) -> float:
    """A bottleneck that some valid partition achieves."""
    found = greedy_partition(costs, p, budgets, memory)
    return _upper_limit(costs) if found is None else found.bottleneck_s


# --------------------------------------------------------------------- the DP
def _banded_dp(costs: StageCosts, p: int, budgets: np.ndarray, limit: float, memory: MemoryMode,
               secondary: Additive | None) -> Partition | None:
    """One DP over (stage, end): min-max time if ``secondary`` is None, else min sum of
    ``secondary`` subject to every stage's time <= ``limit``."""
    n = costs.n
    slack = limit * (1.0 + _REL_TOL) + 1e-18
    prefix = costs.compute_prefix
    # a stage's time is at least its compute and at least its copy-link time (eq. 2)
    swap = costs.swap_prefix
    lo = np.maximum(np.searchsorted(prefix, prefix - slack, side="left"),
                    np.searchsorted(swap, swap - slack, side="left"))
    parents: list[np.ndarray] = []
    value = np.full(n + 1, np.inf)
    value[0] = 0.0
    padded = _Padded(costs)
    for k in range(p):
        ja, jb = k + 1, (n - (p - 1 - k) if k < p - 1 else n)
        if k < p - 1:  # the stages before must fit in k limits, the ones after in p - 1 - k
            for busy in (prefix, swap):
                ja = max(ja, int(np.searchsorted(busy, busy[-1] - (p - 1 - k) * slack, side="left")))
                jb = min(jb, int(np.searchsorted(busy, (k + 1) * slack, side="right")) - 1)
        else:
            ja = n
        reachable = np.flatnonzero(np.isfinite(value))
        new_value = np.full(n + 1, np.inf)
        parent = np.zeros(n + 1, dtype=np.int64)
        if reachable.size:
            ja = max(ja, int(reachable[0]) + 1)
        if reachable.size and ja <= jb:
            js = np.arange(ja, jb + 1)
            best, arg = _best_starts(padded, value, js, np.maximum(lo[js], reachable[0]), int(reachable[-1]),
                                     _StageTerms(costs, k, budgets[k], memory, secondary), slack)
            new_value[js] = best
            parent[js] = arg
        parents.append(parent)
        value = new_value
    return partition_from_dp(costs, parents, value, secondary is not None)


class _Padded:
    """The cost arrays left-padded by ``n`` once per DP, so each stage's windows are slices."""

    def __init__(self, costs: StageCosts) -> None:
        n = costs.n
        self.n = n
        self.compute_prefix, self.comm = costs.compute_prefix, costs.comm
        self.swap_prefix = costs.swap_prefix if costs.has_swaps else None
        zeros = np.zeros(n)
        self.pad_compute = np.concatenate([zeros, costs.compute_prefix])
        self.pad_comm = np.concatenate([zeros, costs.comm])
        self.pad_swap = np.concatenate([zeros, costs.swap_prefix]) if costs.has_swaps else None


class _StageTerms:
    """The arrays one DP step needs besides times: memory prefix (if limited), secondary terms."""

    def __init__(self, costs: StageCosts, stage: int, budget: float, memory: MemoryMode,
                 secondary: Additive | None) -> None:
        self.budget = budget
        self.mem = costs.memory_prefix(stage, memory == "best_case") if np.isfinite(budget) else None
        self.sec = secondary.terms(stage) if secondary is not None else None


def _best_starts(costs: _Padded, value: np.ndarray, js: np.ndarray, first: np.ndarray, last: int,
                 terms: _StageTerms, slack: float) -> tuple[np.ndarray, np.ndarray]:
    """For every end ``j`` in ``js`` (consecutive), the best start in ``[first[j], min(j, last + 1))``.

    For a fixed offset ``d = j - i`` the starts of consecutive ends are consecutive, so a
    block of offsets is a strided window over the prefix arrays: no gathers, no index math.
    """
    nj, ja = js.size, int(js[0])
    max_d = js - first  # largest offset allowed per end
    span = int(max_d.max())
    min_d = max(1, ja - last)
    best = np.full(nj, np.inf)
    arg = np.full(nj, -1, dtype=np.int64)
    if span < min_d:
        return best, arg

    def window(arr: np.ndarray, fill: float) -> np.ndarray:
        # left-padded by ``span`` so every offset has a row; padded starts are never valid
        return _rows(np.concatenate([np.full(span, fill), arr]), nj)

    def padded(arr: np.ndarray) -> np.ndarray:  # the same, from an array padded by n
        return _rows(arr[costs.n - span:], nj)

    c_j, comm_j = costs.compute_prefix[js], costs.comm[js]
    w_c, w_comm, w_value = padded(costs.pad_compute), padded(costs.pad_comm), window(value, np.inf)
    w_x: np.ndarray | None = None
    x_j: np.ndarray | None = None
    if costs.pad_swap is not None and costs.swap_prefix is not None:  # both are set when the costs have swaps
        w_x, x_j = padded(costs.pad_swap), costs.swap_prefix[js]
    w_mem, mem_j = (window(terms.mem, 0.0), terms.mem[js]) if terms.mem is not None else (None, None)
    w_sec, sec_j = (window(terms.sec[1], 0.0), terms.sec[0][js]) if terms.sec is not None else (None, None)
    block = max(1, _BLOCK_ELEMENTS // nj)
    cols = np.arange(nj)
    for d0 in range(min_d, span + 1, block):
        d1 = min(span, d0 + block - 1)
        top = ja + span - d1
        rows = slice(top, ja + span - d0 + 1)  # row r: starts of offset ja + span - r
        # a start before ``first`` is slower than the limit or unreachable (value inf): the
        # limit and the values exclude it without an index test
        t = c_j - w_c[rows]
        if w_x is not None:
            np.maximum(t, x_j - w_x[rows], out=t)
        t += w_comm[rows]
        t += comm_j
        over = t > slack
        if w_mem is not None:
            over |= (mem_j - w_mem[rows]) > terms.budget
        if w_sec is None:
            cand = np.maximum(w_value[rows], t, out=t)
        else:
            cand = w_value[rows] + w_sec[rows]
            cand += sec_j
        np.putmask(cand, over, np.inf)
        row = np.argmin(cand, axis=0)
        got = cand[row, cols]
        better = got < best
        best[better] = got[better]
        arg[better] = (js - (ja + span - top) + row)[better]
    return best, arg


def _rows(arr: np.ndarray, width: int) -> np.ndarray:
    """Row ``r`` is ``arr[r:r + width]``: numpy's sliding_window_view without its checks, which
    cost more than the DP's work on small stages."""
    step = arr.strides[0]
    return as_strided(arr, shape=(arr.size - width + 1, width), strides=(step, step), writeable=False)


# --------------------------------------------------------------------- public entry points
def _stage_budgets(num_stages: int, budgets: np.ndarray | None) -> np.ndarray:
    if budgets is None:
        return np.full(num_stages, np.inf)
    budgets = np.asarray(budgets, dtype=float)
    if budgets.shape != (num_stages,):
        raise ValueError(f"need one memory budget per stage ({num_stages}), got {budgets.size}")
    return budgets


def _check_stages(costs: StageCosts, p: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"number of stages must be a positive integer, got {p!r}")
    if p > costs.n:
        raise ValueError(f"cannot split {costs.n} layers into {p} non-empty stages")


def min_bottleneck(costs: StageCosts, num_stages: int, budgets: np.ndarray | None = None, *,
                   memory: MemoryMode = "fixed") -> Partition | None:
    """The partition into ``num_stages`` contiguous stages with the smallest slowest stage,
    or None when no partition fits the memory limits."""
    _check_stages(costs, num_stages)
    budgets = _stage_budgets(num_stages, budgets)
    ceiling = _upper_limit(costs)
    # The DP's work grows with its limit, so start just above the lower bound and widen: a DP
    # that finds nothing under a limit proves the optimum is above it, and the first that finds
    # a partition has found the optimum. Once the limit is well above the lower bound the
    # greedy's partition caps it (or, if the greedy found none, every segment is tried at
    # once), and if even that limit finds nothing every segment is tried.
    lower = _lower_bound(costs, num_stages)
    limit = lower * (1.0 + _FIRST_SLACK)
    upper: float | None = None
    while True:
        if upper is None and (limit <= 0.0 or limit > lower * _GREEDY_AFTER):
            upper = _upper_bound(costs, num_stages, budgets, memory)
        if upper is not None:  # a valid partition's bottleneck, or the ceiling if the greedy found none
            limit = upper if limit <= 0.0 or upper >= ceiling else min(limit, upper)
        found = _banded_dp(costs, num_stages, budgets, min(limit, ceiling), memory, None)
        if found is not None or limit >= ceiling:
            return found
        if upper is not None and limit >= upper:
            return _banded_dp(costs, num_stages, budgets, ceiling, memory, None)
        limit *= _GROWTH


def min_secondary(costs: StageCosts, num_stages: int, limit: float, secondary: Additive,
                  budgets: np.ndarray | None = None, *, memory: MemoryMode = "fixed") -> Partition | None:
    """Among partitions whose every stage takes <= ``limit``, one with the least total
    ``secondary`` cost (None if there is none)."""
    _check_stages(costs, num_stages)
    return _banded_dp(costs, num_stages, _stage_budgets(num_stages, budgets), limit, memory, secondary)


def exact_partition(costs: StageCosts, num_stages: int, budgets: np.ndarray | None = None, *,
                    min_comm: bool = True, memory: MemoryMode = "fixed") -> Partition:
    """The optimal-bottleneck partition; with ``min_comm`` the one among those with the fewest
    boundary bytes. Raises :class:`InfeasibleError` when the memory limits admit none."""
    _check_stages(costs, num_stages)
    budgets = _stage_budgets(num_stages, budgets)
    check_layers_fit(costs, budgets, memory)
    best = min_bottleneck(costs, num_stages, budgets, memory=memory)
    if best is None:
        raise InfeasibleError(
            f"infeasible: no split into {num_stages} stages fits the memory budget "
            f"(every layer fits some stage alone, but not all of them together)"
        )
    if not min_comm:
        return best
    lean = min_secondary(costs, num_stages, best.bottleneck_s, CommBytes(costs), budgets, memory=memory)
    return lean if lean is not None else best
