"""optimize_sr (vPipe Alg. 2): choose keep / swap / recompute for the layers of one stage.

The paper's three phases, then a local polish:

1. *Free swaps.* Swapping costs nothing while the copy link can carry the traffic inside
   the stage's compute window (eq. 2), so layers are swapped, largest activations first,
   while the link has room. Unlike the paper's line 13-16 loop, this stops as soon as the
   budget holds: a swap nobody needs still takes copy-link bandwidth that boundary
   communication shares (the paper itself gives the network priority, section 4.2).
2. *Paid savings.* While the stage is over budget, the layer with the best memory saved per
   second of added time takes its cheaper operation: recompute costs its forward, swap the
   copy time the link cannot hide (lines 2-9 and 17-19).
3. If the budget still does not hold, layers switch to whichever operation saves the most
   memory; if even that fails, the stage is infeasible and the result says so.
4. *Polish.* Greedy phases can leave obvious improvements (a recompute that has become
   cheaper to swap once the recomputes widened the window, a swap no longer needed), so
   single-layer changes that lower the stage time and keep the budget are applied,
   steepest first, until none is left. The result is therefore locally optimal: no
   single-layer change of D/S/R lowers the stage time while fitting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vpipe.graph import LayerGraph
from vpipe.plan import Policy
from vpipe.planner.cost_model import Code, GraphProfile, Hardware, PipelineSetup, segment_of

__all__ = ["SRResult", "SegmentSR", "optimize_sr", "optimize_segment"]

_POLISH_ROUNDS = 10_000


@dataclass(frozen=True)
class SegmentSR:
    """optimize_sr's answer for positions ``[start, end)`` of a profile."""

    codes: np.ndarray
    time_s: float
    memory_bytes: float
    fits: bool


@dataclass(frozen=True)
class SRResult:
    """optimize_sr's answer for a stage: a policy per layer and what they cost."""

    policies: dict[int, Policy]
    stage_time_s: float
    memory_bytes: float
    fits: bool


class _Stage:
    """Running sums of one stage's time and memory, updated in O(1) per policy change."""

    def __init__(self, profile: GraphProfile, setup: PipelineSetup, start: int, end: int, stage: int) -> None:
        hw = setup.hardware
        # the stage's device: its compute takes this much longer than the reference
        speed = setup.speed(stage)
        self.f = profile.fwd[start:end] * speed
        self.b = profile.bwd[start:end] * speed
        a = profile.act[start:end]
        m = setup.in_flight(stage)
        # resident bytes and link seconds per layer, by policy code D/S/R
        self.resident = np.stack([m * a, a, m * profile.in_bytes[start:end]])
        # a swap's copies out and back: beside the compute (link) or on its thread (extra compute)
        zero, copy = np.zeros_like(a), 2.0 * a / hw.copy_bytes_per_s
        self.link = np.stack([zero, copy if hw.copies_overlap else zero, zero])
        # a copy on the compute thread runs at the device's speed, as StageCosts prices it
        self.extra = np.stack([zero, zero if hw.copies_overlap else copy * speed, self.f])
        self.comm = (profile.cut[start] + profile.cut[end]) / hw.net_bytes_per_s
        self.const_mem = setup.param_factor(stage) * float(profile.params[start:end].sum())
        self.codes = np.zeros(end - start, dtype=np.int8)
        self.compute = float((self.f + self.b).sum())
        self.link_s = 0.0
        self.mem = self.const_mem + float(self.resident[Code.D].sum())

    def time(self, compute: float | np.ndarray, link_s: float | np.ndarray):  # noqa: ANN201
        return compute + np.maximum(0.0, link_s - compute) + self.comm

    @property
    def current_time(self) -> float:
        return float(self.time(self.compute, self.link_s))

    def set(self, i: int, code: int) -> None:
        old = self.codes[i]
        self.compute += self.extra[code, i] - self.extra[old, i]
        self.link_s += self.link[code, i] - self.link[old, i]
        self.mem += self.resident[code, i] - self.resident[old, i]
        self.codes[i] = code

    def saving(self, i: int, code: int) -> float:
        return float(self.resident[self.codes[i], i] - self.resident[code, i])


def optimize_segment(profile: GraphProfile, setup: PipelineSetup, start: int, end: int, stage: int,
                     budget: float) -> SegmentSR:
    """Alg. 2 for the stage holding positions ``[start, end)`` as stage number ``stage``."""
    st = _Stage(profile, setup, start, end, stage)
    if st.mem > budget:
        _free_swaps(st, budget)
    if st.mem > budget:
        _paid_savings(st, budget)
    if st.mem > budget:
        _max_savings(st, budget)
    fits = st.mem <= budget
    if fits:
        _polish(st, budget)
    return SegmentSR(st.codes.copy(), st.current_time, st.mem, fits)


def _free_swaps(st: _Stage, budget: float) -> None:
    room = st.compute - st.link_s
    for i in np.argsort(-st.resident[Code.D], kind="stable"):
        if st.mem <= budget:
            return
        cost = st.link[Code.S, i]
        if st.saving(i, Code.S) > 0 and cost <= room:
            st.set(int(i), Code.S)
            room -= cost


def _paid_savings(st: _Stage, budget: float) -> None:
    saves = st.resident[Code.D] - st.resident  # saving of each code vs keep
    cost = np.stack([np.full_like(st.f, np.inf), st.link[Code.S], st.extra[Code.R]])
    cost[saves <= 0] = np.inf
    op = np.where(cost[Code.R] < cost[Code.S], Code.R, Code.S)
    idx = np.arange(op.size)
    op_cost, op_save = cost[op, idx], saves[op, idx]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        gain = np.where(op_cost > 0, op_save / op_cost, np.inf)
    gain[~np.isfinite(op_cost) | (op_save <= 0) | (st.codes != Code.D)] = -1.0
    for i in np.argsort(-gain, kind="stable"):
        if st.mem <= budget or gain[i] < 0:
            return
        st.set(int(i), int(op[i]))


def _max_savings(st: _Stage, budget: float) -> None:
    best = np.argmin(st.resident, axis=0)
    extra = st.resident[st.codes, np.arange(st.codes.size)] - st.resident[best, np.arange(best.size)]
    for i in np.argsort(-extra, kind="stable"):
        if st.mem <= budget or extra[i] <= 0:
            return
        st.set(int(i), int(best[i]))


def _polish(st: _Stage, budget: float) -> None:
    idx = np.arange(st.codes.size)
    for _ in range(_POLISH_ROUNDS):
        now = st.current_time
        tol = 1e-12 * max(now, 1e-30)
        best_gain, best_move = tol, None
        for code in (Code.D, Code.S, Code.R):
            d_compute = st.extra[code] - st.extra[st.codes, idx]
            d_link = st.link[code] - st.link[st.codes, idx]
            d_mem = st.resident[code] - st.resident[st.codes, idx]
            gain = now - st.time(st.compute + d_compute, st.link_s + d_link)
            gain[(st.mem + d_mem > budget) | (st.codes == code)] = -np.inf
            i = int(np.argmax(gain)) if gain.size else 0
            if gain.size and gain[i] > best_gain:
                best_gain, best_move = gain[i], (i, int(code))
        if best_move is None:
            return
        st.set(*best_move)


def optimize_sr(
    graph: LayerGraph,
    layer_ids: Sequence[int],
    *,
    stage: int,
    num_stages: int,
    schedule: str = "1f1b",
    micro_batches: int = 8,
    memory_budget: float | None = None,
    hardware: Hardware | None = None,
) -> SRResult:
    """Keep/swap/recompute policies for the stage ``stage`` holding ``layer_ids`` (a contiguous run).

    Returns the policies, the stage's time per micro-batch and its peak memory under them;
    ``fits`` is False when no choice of policies brings the stage under ``memory_budget``.
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    if memory_budget is not None and not memory_budget >= 0:
        raise ValueError(f"memory budget must be a non-negative number of bytes, got {memory_budget}")
    profile = GraphProfile(graph)
    setup = PipelineSetup(num_stages, schedule, micro_batches, hardware or Hardware())
    start, end = segment_of(graph, layer_ids)
    budget = math.inf if memory_budget is None else float(memory_budget)
    result = optimize_segment(profile, setup, start, end, stage, budget)
    policies = {lid: Code(int(c)).policy() for lid, c in zip(profile.ids[start:end], result.codes)}
    return SRResult(policies, result.time_s, result.memory_bytes, result.fits)
