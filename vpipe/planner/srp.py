"""The SRP loop (vPipe Alg. 1): swap / recompute / repartition, offline and online.

:func:`plan_pipeline` alternates the two sub-problems of the paper's decomposition until
the plan stops improving: with the partition fixed, :func:`~vpipe.planner.sr.optimize_segment`
picks every stage's policies (Alg. 2); with the policies fixed, the partitioner (Alg. 3, or
the exact oracle) moves the boundaries. The partitioner prices each layer with the time
its current policy costs and tests memory on the best case (every layer on its most frugal
policy), because the next optimize_sr pass will re-choose the policies of the stage it lands in.

:class:`SRPPlanner` is the online form the planner daemon calls with live statistics. It
proposes a new plan only when the predicted gain is worth it:

- *hysteresis*: the predicted step time must improve by at least ``min_gain`` (relative),
  so noise in the statistics of a balanced pipeline cannot trigger plans;
- *gain vs. cost*: ``horizon_steps * gain`` must exceed the time to migrate the layers that
  move; among plans reaching various bottlenecks it picks the one with the best net
  benefit, so it never moves more than the gain justifies, and a policy-only change (no
  layer moves, no migration cost) wins whenever it is enough;
- *cooldown*: after a proposal, none for ``cooldown_steps`` steps, so a plan is applied
  and measured before it is judged.

A stage over its memory budget is the exception: it gets a fix whatever the gain (the
cheapest feasible plan by net benefit), still outside the cooldown.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vpipe.graph import LayerGraph
from vpipe.plan import Plan, PlanError, Policy
from vpipe.planner.cost_model import GraphProfile, Hardware, PipelineSetup, StageCosts
from vpipe.planner.exact import InfeasibleError, Partition, check_layers_fit, exact_partition, min_secondary
from vpipe.planner.partition import kl_partition
from vpipe.planner.sr import optimize_segment

__all__ = ["METHODS", "PlanResult", "Proposal", "SRPPlanner", "plan_pipeline", "InfeasibleError"]

METHODS = ("kl", "exact")
_MAX_ITERATIONS = 8
_REL_TOL = 1e-9
# bottleneck targets (relative to the best plan's) at which the online planner also looks
# for the partition that moves the fewest bytes
_TARGET_SLACK = (0.0, 0.02, 0.05, 0.1, 0.2)


# --------------------------------------------------------------------- results
@dataclass(frozen=True)
class PlanResult:
    """A plan for a pipeline and what the cost model predicts for it."""

    stages: list[list[int]]
    policies: dict[int, Policy]
    bottleneck_s: float
    comm_bytes: int
    planner_s: float
    stage_times_s: list[float]
    stage_memory_bytes: list[float]
    step_s: float
    method: str
    iterations: int

    def to_plan(self, epoch: int = 0, reason: str = "") -> Plan:
        """The wire-format :class:`~vpipe.plan.Plan` of this result."""
        return Plan(epoch=epoch, stages=tuple(tuple(s) for s in self.stages), policies=dict(self.policies),
                    predicted_step_s=self.step_s, reason=reason or f"{self.method} plan")

    def summary(self) -> dict[str, Any]:
        """The ``vpipe plan --json`` object."""
        return {
            "stages": [list(s) for s in self.stages],
            "policies": {str(k): v.value for k, v in self.policies.items()},
            "bottleneck_ms": self.bottleneck_s * 1e3,
            "comm_bytes": self.comm_bytes,
            "planner_s": self.planner_s,
        }


@dataclass(frozen=True)
class _Evaluated:
    cuts: tuple[int, ...]
    codes: np.ndarray
    times: np.ndarray
    memory: np.ndarray
    fits: bool
    step_s: float
    comm_bytes: int

    @property
    def bottleneck_s(self) -> float:
        return float(self.times.max())


def _fastest_step(profile: GraphProfile, setup: PipelineSetup) -> float:
    """A lower bound on any plan's step: every layer kept (D is never slower than S or R) and the compute
    spread evenly over the stages (a stage's time is at least its layers' compute; the slowest at least the
    mean), no transfers."""
    compute = float(np.sum(profile.fwd + profile.bwd))
    return setup.step_time(np.full(setup.num_stages, compute / setup.num_stages))


def _check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown planning method {method!r}; expected one of {', '.join(METHODS)}")
    return method


def _evaluate(profile: GraphProfile, setup: PipelineSetup, budgets: np.ndarray, cuts: Sequence[int],
              codes: np.ndarray) -> _Evaluated:
    costs = StageCosts(profile, setup, codes)
    times, memory = costs.stage_times(cuts), costs.stage_memory(cuts)
    return _Evaluated(tuple(int(c) for c in cuts), codes, times, memory,
                      bool(np.all(memory <= budgets * (1 + _REL_TOL))), setup.step_time(times),
                      costs.comm_bytes(cuts))


def _optimize_stages(profile: GraphProfile, setup: PipelineSetup, budgets: np.ndarray,
                     cuts: Sequence[int]) -> _Evaluated:
    """Alg. 2 on every stage of a partition."""
    bounds = [0, *cuts, profile.n]
    codes = np.zeros(profile.n, dtype=np.int8)
    for k in range(len(bounds) - 1):
        result = optimize_segment(profile, setup, bounds[k], bounds[k + 1], k, float(budgets[k]))
        codes[bounds[k]:bounds[k + 1]] = result.codes
    return _evaluate(profile, setup, budgets, cuts, codes)


def _partition(costs: StageCosts, p: int, budgets: np.ndarray, method: str) -> Partition:
    if method == "kl":
        found = kl_partition(costs, p, budgets, memory="best_case")
        if found is not None:
            return found
        # the KL bands hold no feasible boundaries: the oracle decides (and names the problem)
    return exact_partition(costs, p, budgets, memory="best_case")


def _better(a: _Evaluated, b: _Evaluated | None) -> bool:
    if b is None:
        return True
    if a.bottleneck_s < b.bottleneck_s * (1 - _REL_TOL):
        return True
    return a.bottleneck_s <= b.bottleneck_s * (1 + _REL_TOL) and a.comm_bytes < b.comm_bytes


def _srp_loop(profile: GraphProfile, setup: PipelineSetup, budgets: np.ndarray, method: str,
              max_iterations: int = _MAX_ITERATIONS) -> tuple[_Evaluated, int]:
    """Alg. 1: repartition with the current policies, re-choose policies, until no better plan."""
    check_layers_fit(StageCosts(profile, setup), budgets, "best_case")
    codes = np.zeros(profile.n, dtype=np.int8)
    best: _Evaluated | None = None
    iterations = 0
    for iterations in range(1, max_iterations + 1):  # noqa: B007 (the count is returned)
        part = _partition(StageCosts(profile, setup, codes), setup.num_stages, budgets, method)
        plan = _optimize_stages(profile, setup, budgets, part.cuts)
        if not _better(plan, best):
            break
        best = plan
        if np.array_equal(plan.codes, codes):
            break
        codes = plan.codes
    assert best is not None
    over = [k for k in range(setup.num_stages) if best.memory[k] > budgets[k] * (1 + 1e-9)]
    if over:
        # every layer fits alone, but the partitioner found no split whose stages all fit
        k = over[0]
        raise InfeasibleError(f"infeasible: stage {k} needs {best.memory[k]:.0f} bytes > budget {budgets[k]:.0f} "
                              f"even with its layers at their leanest policies ({method} partition)")
    return best, iterations


def _result(profile: GraphProfile, setup: PipelineSetup, plan: _Evaluated, method: str, iterations: int,
            seconds: float) -> PlanResult:
    return PlanResult(
        stages=profile.stages_of(plan.cuts),
        policies=profile.policies_from(plan.codes),
        bottleneck_s=plan.bottleneck_s,
        comm_bytes=plan.comm_bytes,
        planner_s=seconds,
        stage_times_s=[float(t) for t in plan.times],
        stage_memory_bytes=[float(m) for m in plan.memory],
        step_s=plan.step_s,
        method=method,
        iterations=iterations,
    )


def plan_pipeline(
    graph: LayerGraph,
    num_stages: int,
    *,
    schedule: str = "1f1b",
    micro_batches: int = 8,
    memory_budget: int | float | Sequence[int | float] | None = None,
    method: str = "kl",
    hardware: Hardware | None = None,
    in_flight_counts: Sequence[int] | None = None,
    stage_ranks: Sequence[int] | None = None,
) -> PlanResult:
    """Plan ``graph`` onto ``num_stages`` stages: partition and per-layer D/S/R policies.

    ``memory_budget`` is bytes per stage (one number for all, or one per stage; one number
    is a rank's, shared equally by its stages). A multi-stage schedule needs each stage's
    peak in-flight micro-batches and rank, as the live planner gets them (see
    :class:`~vpipe.planner.setup.PipelineSetup`). Raises
    ``ValueError`` for bad arguments and :class:`InfeasibleError` (a ``ValueError``) when
    no plan fits the budget, naming the layer that cannot fit when there is one.
    """
    started = time.perf_counter()
    _check_method(method)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"number of stages must be a positive integer, got {num_stages!r}")
    if num_stages > len(graph):
        raise ValueError(f"cannot split {len(graph)} layers into {num_stages} non-empty stages")
    setup = PipelineSetup(num_stages, schedule, micro_batches, hardware or Hardware(),
                          in_flight_counts=None if in_flight_counts is None else tuple(in_flight_counts),
                          stage_ranks=None if stage_ranks is None else tuple(stage_ranks))
    budgets = setup.budgets(memory_budget)
    profile = GraphProfile(graph)
    plan, iterations = _srp_loop(profile, setup, budgets, method)
    return _result(profile, setup, plan, method, iterations, time.perf_counter() - started)


# --------------------------------------------------------------------- online planner
@dataclass(frozen=True)
class Proposal:
    """A plan the online planner recommends, with the numbers that justify it."""

    plan: Plan
    before_step_s: float
    after_step_s: float
    migration_bytes: int
    migration_s: float
    moved_layers: int
    reason: str

    @property
    def policy_only(self) -> bool:
        return self.moved_layers == 0

    @property
    def gain(self) -> float:
        """Relative step-time improvement predicted (0.1 = 10 % faster steps)."""
        if not math.isfinite(self.before_step_s) or self.before_step_s <= 0:
            return 0.0
        return 1.0 - self.after_step_s / self.before_step_s


class _MigrationBytes:
    """Bytes a partition moves from the current placement, as an additive per-stage cost."""

    def __init__(self, profile: GraphProfile, setup: PipelineSetup, current_stage: np.ndarray) -> None:
        self.current = current_stage
        self.per_hop = _per_hop_bytes(profile, setup, current_stage)
        self._cache: dict[int, np.ndarray] = {}

    def terms(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        prefix = self._cache.get(stage)
        if prefix is None:
            moved = self.per_hop * np.abs(self.current - stage)
            prefix = self._cache[stage] = np.concatenate([[0.0], np.cumsum(moved)])
        return prefix, -prefix


def _per_hop_bytes(profile: GraphProfile, setup: PipelineSetup, current_stage: np.ndarray) -> np.ndarray:
    """What one neighbour hop of each layer sends: weights and optimizer state; for PipeDream
    also the stashed weight versions and the inputs of its in-flight micro-batches."""
    hw = setup.hardware
    out = profile.params * (1.0 + hw.optimizer_factor)
    if setup.schedule == "pipedream":
        versions = setup.num_stages - current_stage  # p - k for the stage it leaves
        out = out + profile.params * (versions - 1) + versions * profile.in_bytes
    return out


class SRPPlanner:
    """Online SRP planner: turns live statistics into plan proposals, or into silence."""

    def __init__(
        self,
        num_stages: int,
        schedule: str = "1f1b",
        micro_batches: int = 8,
        memory_budget: int | float | Sequence[int | float] | None = None,
        hardware: Hardware | None = None,
        *,
        horizon_steps: int = 500,
        min_gain: float = 0.05,
        cooldown_steps: int = 20,
        method: str = "kl",
        allow_moves: bool = True,
        in_flight_counts: tuple[int, ...] | None = None,
        stage_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.setup = PipelineSetup(num_stages, schedule, micro_batches, hardware or Hardware(),
                                   in_flight_counts=in_flight_counts, stage_ranks=stage_ranks)
        self.budgets = self.setup.budgets(memory_budget)
        if not (isinstance(horizon_steps, int) and horizon_steps >= 1):
            raise ValueError(f"horizon_steps must be a positive integer, got {horizon_steps!r}")
        if not (0.0 <= min_gain < 1.0):
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
        if not (isinstance(cooldown_steps, int) and cooldown_steps >= 0):
            raise ValueError(f"cooldown_steps must be a non-negative integer, got {cooldown_steps!r}")
        self.horizon_steps, self.min_gain, self.cooldown_steps = horizon_steps, min_gain, cooldown_steps
        self.method = _check_method(method)
        self.allow_moves = allow_moves  # False: only the policies of the current partition change
        self.last_proposal_step: int | None = None

    @property
    def num_stages(self) -> int:
        return self.setup.num_stages

    def in_cooldown(self, step: int) -> bool:
        return self.last_proposal_step is not None and step - self.last_proposal_step < self.cooldown_steps

    def propose(self, graph: LayerGraph, current: Plan, step: int,
                placeable: Callable[[list[list[int]]], bool] | None = None) -> Proposal | None:
        """A better plan for ``graph``'s latest statistics than ``current``, or None.

        None inside the cooldown, when the predicted gain is under ``min_gain``, or when
        ``horizon_steps`` of gain do not pay for the migration. Raises
        :class:`InfeasibleError` when no plan can fit the memory budget. Plans that move
        layers are left out when moves are off, and when ``placeable(stages)`` says the
        stages cannot build the layers that would arrive.
        """
        if self.in_cooldown(step):
            return None
        profile = GraphProfile(graph)
        setup, budgets = self.setup, self.budgets
        if current.num_stages != setup.num_stages:
            raise PlanError(f"current plan has {current.num_stages} stages, the planner {setup.num_stages}")
        before = self._current(profile, current)
        if before is not None and before.fits and before.step_s - _fastest_step(profile, setup) \
                < self.min_gain * before.step_s:
            return None  # no placement or policy can gain min_gain (a balanced pipeline that fits): no search
        best, _ = _srp_loop(profile, setup, budgets, self.method)
        if before is not None and before.fits and before.step_s - best.step_s < self.min_gain * before.step_s:
            # even the best plan, moved for free, is inside the hysteresis band: stay (and skip the DPs)
            policies_only = _optimize_stages(profile, setup, budgets, before.cuts)
            if before.step_s - policies_only.step_s < self.min_gain * before.step_s:
                return None
        candidates = [c for c in self._candidates(profile, before, best, current)
                      if c[1] == 0 or (self.allow_moves
                                       and (placeable is None or placeable(profile.stages_of(c[0].cuts))))]
        chosen = self._choose(before, candidates)
        if chosen is None:
            return None
        plan, moved, moved_bytes, why = chosen
        migration_s = moved_bytes / setup.hardware.net_bytes_per_s
        before_step = before.step_s if before is not None else math.inf
        reason = (f"{why}: step {_ms(before_step)} -> {_ms(plan.step_s)} ms predicted, "
                  f"{moved} layer(s) move ({moved_bytes / 1e6:.1f} MB, {migration_s * 1e3:.1f} ms)")
        new_plan = Plan(epoch=current.epoch + 1, stages=tuple(tuple(s) for s in profile.stages_of(plan.cuts)),
                        policies=profile.policies_from(plan.codes), predicted_step_s=plan.step_s, reason=reason)
        self.last_proposal_step = step
        return Proposal(new_plan, before_step, plan.step_s, int(round(moved_bytes)), migration_s, moved, reason)

    # ----------------------------------------------------------------- internals
    def _current(self, profile: GraphProfile, current: Plan) -> _Evaluated | None:
        """The running plan under the new statistics; None if it no longer covers the graph."""
        try:
            current.check_against(profile.ids, self.setup.num_stages)
        except PlanError:
            return None  # layers were added or removed: the old plan cannot run this graph
        cuts = profile.cuts_of(current.stages)
        return _evaluate(profile, self.setup, self.budgets, cuts, profile.codes_from(current.policies))

    def _candidates(self, profile: GraphProfile, before: _Evaluated | None, best: _Evaluated,
                    current: Plan) -> list[tuple[_Evaluated, int, float]]:
        """(plan, layers moved, bytes moved) for: policies only, the best plan, and the plans
        that move fewest bytes to reach bottlenecks between the best and the current one."""
        setup, budgets = self.setup, self.budgets
        if before is None:  # layers changed: only the surviving layers that change stage move
            old_stage = {lid: k for k, layers in enumerate(current.stages) for lid in layers}
            new_stage = np.repeat(np.arange(setup.num_stages), np.diff([0, *best.cuts, profile.n]))
            was = np.array([old_stage.get(lid, k) for lid, k in zip(profile.ids, new_stage)])
            hops = np.abs(new_stage - was)
            per_hop = _per_hop_bytes(profile, setup, was)
            return [(best, int(np.count_nonzero(hops)), float(np.sum(per_hop * hops)))]
        current_stage = np.repeat(np.arange(setup.num_stages), np.diff([0, *before.cuts, profile.n]))
        migration = _MigrationBytes(profile, setup, current_stage)
        out: list[tuple[_Evaluated, int, float]] = []

        def add(plan: _Evaluated) -> None:
            stage = np.repeat(np.arange(setup.num_stages), np.diff([0, *plan.cuts, profile.n]))
            hops = np.abs(stage - current_stage)
            out.append((plan, int(np.count_nonzero(hops)), float(np.sum(migration.per_hop * hops))))

        add(_optimize_stages(profile, setup, budgets, before.cuts))
        add(best)
        ceiling = before.bottleneck_s if before.fits else math.inf
        costs = StageCosts(profile, setup, best.codes)
        for slack in _TARGET_SLACK:
            limit = best.bottleneck_s * (1 + slack)
            if limit >= ceiling:
                break
            lean = min_secondary(costs, setup.num_stages, limit, migration, budgets, memory="best_case")
            if lean is not None:
                add(_optimize_stages(profile, setup, budgets, lean.cuts))
        return out

    def _choose(self, before: _Evaluated | None,
                candidates: list[tuple[_Evaluated, int, float]]) -> tuple[_Evaluated, int, float, str] | None:
        net = self.setup.hardware.net_bytes_per_s
        feasible = [c for c in candidates if c[0].fits]
        if not feasible:
            return None
        if before is None or not before.fits:
            # the running plan cannot run (layers changed) or overflows memory: fix it
            base = before.step_s if before is not None else max(c[0].step_s for c in feasible)
            plan, moved, moved_bytes = max(
                feasible, key=lambda c: (self.horizon_steps * (base - c[0].step_s) - c[2] / net, -c[2]))
            why = "layers changed" if before is None else "memory over budget"
            return plan, moved, moved_bytes, why
        worthwhile = []
        for plan, moved, moved_bytes in feasible:
            gain = before.step_s - plan.step_s
            benefit = self.horizon_steps * gain - moved_bytes / net
            if gain >= self.min_gain * before.step_s and benefit > 0:
                worthwhile.append((benefit, -moved_bytes, plan, moved, moved_bytes))
        if not worthwhile:
            return None
        _, _, plan, moved, moved_bytes = max(worthwhile, key=lambda w: (w[0], w[1]))
        return plan, moved, moved_bytes, ("policies" if moved == 0 else "rebalance")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if math.isfinite(seconds) else "inf"
