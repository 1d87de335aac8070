"""The SRP loop (vPipe Alg. 1): swap / recompute / repartition, offline and online.

:func:`plan_pipeline` alternates the two sub-problems of the paper's decomposition until
the plan stops improving: with the partition fixed, :func:`~vpipe.planner.sr.optimize_segment`
picks every stage's policies (Alg. 2); with the policies fixed, the partitioner (Alg. 3, or
the exact oracle) moves the boundaries. The partitioner prices each layer with the time
its current policy costs and tests memory on the best case (every layer on its most frugal
policy), because the next optimize_sr pass will re-choose the policies of the stage it lands in.

The online form the planner daemon calls, which proposes a plan only when it is worth
moving to, is :class:`~vpipe.planner.proposals.SRPPlanner`; it runs the same loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vpipe.graph import LayerGraph
from vpipe.plan import Plan, Policy
from vpipe.planner.cost_model import GraphProfile, Hardware, PipelineSetup, StageCosts
from vpipe.planner.cuts import InfeasibleError, Partition, check_layers_fit
from vpipe.planner.exact import exact_partition
from vpipe.planner.partition import kl_partition
from vpipe.planner.sr import optimize_segment
from vpipe.planner.uneven import uneven_partition

__all__ = ["METHODS", "PlanResult", "Evaluated", "plan_pipeline", "srp_loop", "optimize_stages", "evaluate",
           "fastest_step", "check_method", "InfeasibleError"]

METHODS = ("kl", "exact")
_MAX_ITERATIONS = 8
_REL_TOL = 1e-9


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
class Evaluated:
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


def fastest_step(profile: GraphProfile, setup: PipelineSetup) -> float:
    """A lower bound on any plan's step: every layer kept (D is never slower than S or R) and the compute
    spread evenly over the stages (a stage's time is at least its layers' compute; the slowest at least the
    mean), no transfers."""
    compute = float(np.sum(profile.fwd + profile.bwd))
    # stages of equal time T hold T / speed_k of the compute each: T = compute / sum(1 / speed_k)
    return setup.step_time(np.full(setup.num_stages, compute / float(np.sum(1.0 / setup.speeds()))))


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown planning method {method!r}; expected one of {', '.join(METHODS)}")
    return method


def evaluate(profile: GraphProfile, setup: PipelineSetup, budgets: np.ndarray, cuts: Sequence[int],
              codes: np.ndarray) -> Evaluated:
    costs = StageCosts(profile, setup, codes)
    times, memory = costs.stage_times(cuts), costs.stage_memory(cuts)
    return Evaluated(tuple(int(c) for c in cuts), codes, times, memory,
                      bool(np.all(memory <= budgets * (1 + _REL_TOL))), setup.step_time(times),
                      costs.comm_bytes(cuts))


def optimize_stages(profile: GraphProfile, setup: PipelineSetup, budgets: np.ndarray,
                     cuts: Sequence[int]) -> Evaluated:
    """Alg. 2 on every stage of a partition."""
    bounds = [0, *cuts, profile.n]
    codes = np.zeros(profile.n, dtype=np.int8)
    for k in range(len(bounds) - 1):
        result = optimize_segment(profile, setup, bounds[k], bounds[k + 1], k, float(budgets[k]))
        codes[bounds[k]:bounds[k + 1]] = result.codes
    return evaluate(profile, setup, budgets, cuts, codes)


def _partition(costs: StageCosts, p: int, budgets: np.ndarray, method: str) -> Partition:
    # each stage priced on its own device: the homogeneous searches' bounds do not hold
    if costs.setup.uneven:
        found = uneven_partition(costs, p, budgets, memory="best_case")
        if found is None:
            raise InfeasibleError(f"infeasible: no split into {p} stages fits the memory budget")
        return found
    if method == "kl":
        found = kl_partition(costs, p, budgets, memory="best_case")
        if found is not None:
            return found
        # the KL bands hold no feasible boundaries: the oracle decides (and names the problem)
    return exact_partition(costs, p, budgets, memory="best_case")


def _better(a: Evaluated, b: Evaluated | None) -> bool:
    if b is None:
        return True
    if a.bottleneck_s < b.bottleneck_s * (1 - _REL_TOL):
        return True
    return a.bottleneck_s <= b.bottleneck_s * (1 + _REL_TOL) and a.comm_bytes < b.comm_bytes


def srp_loop(profile: GraphProfile, setup: PipelineSetup, budgets: np.ndarray, method: str,
              max_iterations: int = _MAX_ITERATIONS) -> tuple[Evaluated, int]:
    """Alg. 1: repartition with the current policies, re-choose policies, until no better plan."""
    check_layers_fit(StageCosts(profile, setup), budgets, "best_case")
    codes = np.zeros(profile.n, dtype=np.int8)
    best: Evaluated | None = None
    iterations = 0
    for iterations in range(1, max_iterations + 1):  # noqa: B007 (the count is returned)
        part = _partition(StageCosts(profile, setup, codes), setup.num_stages, budgets, method)
        plan = optimize_stages(profile, setup, budgets, part.cuts)
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
        raise InfeasibleError(f"infeasible: stage {k} needs {best.memory[k]:.0f} bytes > "
                              f"budget {budgets[k]:.0f} "
                              f"even with its layers at their leanest policies ({method} partition)")
    return best, iterations


def _result(profile: GraphProfile, setup: PipelineSetup, plan: Evaluated, method: str, iterations: int,
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
    stage_speeds: Sequence[float] | None = None,
) -> PlanResult:
    """Plan ``graph`` onto ``num_stages`` stages: partition and per-layer D/S/R policies.

    ``memory_budget`` is bytes per stage (one number for all, or one per stage; one number
    is a rank's, shared equally by its stages). A multi-stage schedule needs each stage's
    peak in-flight micro-batches and rank, as the live planner gets them (see
    :class:`~vpipe.planner.setup.PipelineSetup`). ``stage_speeds`` gives each stage's device its compute
    time relative to the reference (2.0: half as fast); the layers' times are the reference's. Raises
    ``ValueError`` for bad arguments and :class:`InfeasibleError` (a ``ValueError``) when
    no plan fits the budget, naming the layer that cannot fit when there is one.
    """
    started = time.perf_counter()
    check_method(method)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"number of stages must be a positive integer, got {num_stages!r}")
    if num_stages > len(graph):
        raise ValueError(f"cannot split {len(graph)} layers into {num_stages} non-empty stages")
    setup = PipelineSetup(num_stages, schedule, micro_batches, hardware or Hardware(),
                          in_flight_counts=None if in_flight_counts is None else tuple(in_flight_counts),
                          stage_ranks=None if stage_ranks is None else tuple(stage_ranks),
                          stage_speeds=None if stage_speeds is None else tuple(stage_speeds))
    budgets = setup.budgets(memory_budget)
    profile = GraphProfile(graph)
    plan, iterations = srp_loop(profile, setup, budgets, method)
    return _result(profile, setup, plan, method, iterations, time.perf_counter() - started)
