"""Exact partitions when the stages' devices run at different speeds.

On uneven devices (a straggler, an older GPU, a GPU shared with another job) the same run of
layers takes a different time on each stage, so the bounds and bands that make the
homogeneous oracle (:mod:`vpipe.planner.exact`) fast do not hold. Live pipelines have few
stages and a few hundred blocks at most, so a plain dynamic program over (stage, end) with
every start tried is cheap: O(p * n^2) cells, vectorised per stage. Beyond
``_MAX_CELLS`` cells it runs on the coarsened boundaries (:mod:`vpipe.planner.coarsen`),
which keeps a few candidate cuts per stage whatever the graph's size.

Both objectives of the homogeneous oracle are here: the smallest slowest stage, and the least
additive secondary cost (boundary bytes, migration bytes) among partitions whose every stage
is within a time limit.
"""

from __future__ import annotations

import numpy as np

from vpipe.planner.coarsen import coarsen
from vpipe.planner.cost_model import CoarseCosts, StageCosts
from vpipe.planner.cuts import Additive, CommBytes, MemoryMode, Partition, partition_from_dp

__all__ = ["uneven_partition", "uneven_min_secondary"]

_MAX_CELLS = 30_000_000  # (start, end) pairs over all stages: above this the DP runs on coarse boundaries
_REL_TOL = 1e-9


def uneven_partition(costs: StageCosts, num_stages: int, budgets: np.ndarray, memory: MemoryMode = "fixed"
                     ) -> Partition | None:
    """The partition with the smallest slowest stage, each stage priced on its own device; among those, the
    fewest boundary bytes. None when no partition fits the memory limits."""
    view = _view(costs, num_stages)
    best = _dp(view, num_stages, budgets, memory, None, None)
    if best is None:
        return None
    lean = _dp(view, num_stages, budgets, memory, best.bottleneck_s, CommBytes(view))
    return _full(costs, view, lean or best)


def uneven_min_secondary(costs: StageCosts, num_stages: int, limit: float, secondary: Additive,
                         budgets: np.ndarray, memory: MemoryMode = "fixed") -> Partition | None:
    """Among partitions whose every stage takes at most ``limit`` on its device, one with the least
    ``secondary`` cost (None if there is none). Exact on every boundary (the secondary terms are the full
    graph's)."""
    return _dp(costs, num_stages, budgets, memory, limit, secondary)


def _view(costs: StageCosts, num_stages: int) -> StageCosts:
    if (costs.n + 1) ** 2 * num_stages // 2 <= _MAX_CELLS:
        return costs
    return CoarseCosts(costs, coarsen(costs, num_stages).bounds)


def _full(costs: StageCosts, view: StageCosts, found: Partition) -> Partition:
    if view is costs:
        return found
    assert isinstance(view, CoarseCosts)
    cuts = view.full_cuts(found.cuts)
    return Partition(tuple(cuts), float(costs.stage_times(cuts).max()), found.secondary)


def _dp(costs: StageCosts, p: int, budgets: np.ndarray, memory: MemoryMode, limit: float | None,
        secondary: Additive | None) -> Partition | None:
    """Min-max stage time (``secondary`` None), or min total ``secondary`` with every stage <= ``limit``."""
    n = costs.n
    if p > n:
        return None
    starts = np.arange(n + 1)
    c, comm = costs.compute_prefix, costs.comm
    x = costs.swap_prefix if costs.has_swaps else None
    # span[i, j] = compute of [i, j) on the reference device; only i < j is a stage
    span = c[None, :] - c[:, None]
    valid = starts[:, None] < starts[None, :]
    link = (x[None, :] - x[:, None]) if x is not None else None
    boundary = comm[:, None] + comm[None, :]
    slack = None if limit is None else limit * (1.0 + _REL_TOL) + 1e-18
    value = np.full(n + 1, np.inf)
    value[0] = 0.0
    parents = []
    for k in range(p):
        t = span * costs.speeds[k]
        if link is not None:
            t = np.maximum(t, link)
        t = t + boundary
        ok = valid.copy()
        # the stages before need a layer each, and so do the stages after
        ok[:k, :] = False
        ok[:, : k + 1] = False
        if k < p - 1:
            ok[:, n - (p - 1 - k) + 1:] = False
        else:
            ok[:, :n] = False
        if np.isfinite(budgets[k]):
            mem = costs.memory_prefix(k, memory == "best_case")
            ok &= (mem[None, :] - mem[:, None]) <= budgets[k]
        if slack is not None:
            ok &= t <= slack
        if secondary is None:
            cand = np.maximum(value[:, None], t)
        else:
            end, start = secondary.terms(k)
            cand = value[:, None] + start[:, None] + end[None, :]
        cand = np.where(ok, cand, np.inf)
        arg = np.argmin(cand, axis=0)
        value = cand[arg, starts]
        parents.append(arg)
    return partition_from_dp(costs, parents, value, secondary is not None)
