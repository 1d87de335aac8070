"""Refining a partition's boundaries at full resolution (vPipe Alg. 3, step 4), all boundaries at once.

Moving one boundary changes two stages, so boundaries refined one at a time stall at
local peaks (three stages 10, 12, 10 with a heaviest layer of 2 cannot improve pairwise),
and shifting work between distant stages needs every boundary between them to move. So
each boundary gets a candidate set, every position within a fifth of a mean stage of it
plus the nearest coarse boundaries and the graph's cheapest boundaries and the positions
next to its neighbours (all positions when the graph is small enough), and one Viterbi
pass over the candidate sets picks the jointly best positions: min-max time, then the
fewest bytes at that time. The sets are re-centred on the result and the pass repeated
while it improves (in the first rounds by anything, later by any time or by more than
``_MIN_GAIN`` of the bytes). Its work is bounded by ``_CELLS`` (start, end) pairs per
pass, all of a pass's times computed in one numpy call.
"""

from __future__ import annotations

import numpy as np

from vpipe.planner.cost_model import StageCosts
from vpipe.planner.cuts import MemoryMode

__all__ = ["refine"]

_CELLS = 600_000  # refinement: (stage start, stage end) pairs examined per Viterbi pass
_BAND = 0.2  # ... every position within +- this fraction of a mean stage's compute,
_MIN_BAND = 4  # ... at least this many either side, then the nearest coarse boundaries
_ROUNDS = 6
_MIN_GAIN = 0.01  # ... while a round gains more than this fraction of the boundary bytes (or any time),
_SURE_ROUNDS = 2  # ... or while it is one of the first rounds (a time gain can follow a round of bytes)
_REL_TOL = 1e-9


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
