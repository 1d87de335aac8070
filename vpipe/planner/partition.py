"""Layer partition (vPipe Alg. 3): coarsen, partition the coarse chain, uncoarsen, refine.

Every result is a valid pipeline: a stage is a contiguous run of the execution order, so
no edge can go from a later stage to an earlier one (general graph partitioners, plain KL
and METIS alike, produce cyclic stage graphs on real DNN graphs). The cost of a partition
is the slowest stage's time first (:class:`StageCosts`, boundary transfers included) and
the boundary bytes second.

1. *Coarsen* (O(n + E), :mod:`vpipe.planner.coarsen`): layers in invoke-time order are
   grouped into a few coarse nodes per mean stage, and no coarse boundary cuts through a
   block's internal branches.
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
   stages. The KL bisection (:mod:`vpipe.planner.bisection`) remains for coarse chains too
   big for the DP (far beyond 128 stages).
3. *Uncoarsen*: coarse boundaries are positions of the full graph.
4. *Refine* the boundaries at full resolution (:mod:`vpipe.planner.refine`): one Viterbi
   pass over candidate positions of every boundary picks the jointly best ones, repeated
   while it improves. When swaps are planned
   a stage's time is ``max(compute, copy)``, which the bisection's per-side estimates
   cannot see, so after a bisection the refinement also starts from the greedy probe's
   partition and keeps the better result (the DPs price it exactly).
"""

from __future__ import annotations

import numpy as np

from vpipe.planner.bisection import recursive_bisection
from vpipe.planner.coarsen import coarsen
from vpipe.planner.cost_model import CoarseCosts, StageCosts
from vpipe.planner.cuts import CommBytes, MemoryMode, Partition
from vpipe.planner.exact import dp_cells, greedy_partition, min_bottleneck, min_secondary
from vpipe.planner.refine import refine

__all__ = ["chain_dp", "kl_partition", "is_valid_pipeline"]

_EXACT_CELLS = 8_000_000  # the partition step: the exact DP on every boundary up to this estimated work,
_COARSE_CELLS = 40_000_000  # ... on the coarse boundaries up to this, else KL bisection (see kl_partition)


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
    if coarse.num_nodes >= num_stages and dp_cells(CoarseCosts(costs, coarse.bounds),
                                                   num_stages) <= _COARSE_CELLS:
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
