"""Recursive Kernighan-Lin bisection over the coarse boundaries (vPipe Alg. 3's ``partition``).

The layer partition uses it only for coarse chains too big for the exact DP (far beyond
128 stages): ``p`` stages split into ``p // 2`` and the rest, at a coarse boundary chosen
by Kernighan-Lin: moves carry the boundary vertex across, a move's gain is the change in
(memory overflow, imbalance beyond a 3 % tolerance, boundary bytes), and each pass keeps
its best prefix of moves. A side's load counts its inner boundaries' transfers, priced at
its cheapest coarse boundaries. With a single contiguous boundary only the two vertices
next to it are movable and a moved vertex is locked, so a pass slides the boundary in one
direction; a pass's moves are evaluated together with numpy.
"""

from __future__ import annotations

import heapq

import numpy as np

from vpipe.planner.coarsen import CoarseGraph
from vpipe.planner.cost_model import StageCosts
from vpipe.planner.cuts import MemoryMode

__all__ = ["recursive_bisection"]

_BALANCE_TOL = 0.03  # bisection: imbalance below this is free, so boundary bytes decide


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
    overflow = _memory_overflow(costs, candidates, lo, hi, left_stages, right_stages, first_stage, budgets,
                                memory)
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
                     right_stages: int, first_stage: int, budgets: np.ndarray,
                     memory: MemoryMode) -> np.ndarray:
    """How far each side's average stage would exceed its tightest budget (0 when it fits)."""
    out = np.zeros(candidates.size)
    sides = ((first_stage, left_stages, lo, candidates),
             (first_stage + left_stages, right_stages, candidates, hi))
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
