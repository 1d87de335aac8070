"""The online SRP planner: a new plan proposed only when its predicted gain is worth the move.

:class:`SRPPlanner` is what the planner daemon calls with live statistics
(:mod:`vpipe.planner.online` turns them into a layer graph). It runs the SRP loop
(:func:`~vpipe.planner.srp.srp_loop`) and proposes a new plan only when the predicted gain
is worth it:

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vpipe.graph import LayerGraph
from vpipe.monitors.records import StageRecord
from vpipe.plan import PINNED_KIND, Plan, PlanError
from vpipe.planner.cost_model import GraphProfile, Hardware, PipelineSetup, StageCosts
from vpipe.planner.exact import min_secondary
from vpipe.planner.setup import streams, weight_versions
from vpipe.planner.srp import Evaluated, check_method, evaluate, fastest_step, optimize_stages, srp_loop
from vpipe.planner.uneven import uneven_min_secondary

__all__ = ["Proposal", "SRPPlanner", "placeable_partitions"]

# bottleneck targets (relative to the best plan's) at which the planner also looks for the partition that
# moves the fewest bytes
_TARGET_SLACK = (0.0, 0.02, 0.05, 0.1, 0.2)
# and further where the schedule keeps a boundary fixed: the best plan that keeps it may be far from the best
_KEPT_SLACK = (0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
_WRONG_SIDE = 1e18  # the cost of a layer on the wrong side of a fixed boundary, beyond any bytes moved


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
    stage_s_before: tuple[float, ...] = ()  # predicted per micro-batch, each stage on its own device
    stage_s_after: tuple[float, ...] = ()

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


class _KeepBoundaries:
    """An additive cost: ``inner``'s, plus a price no partition that keeps the fixed boundaries pays for each
    layer on the wrong side of one (``fixed``: stage -> the position its first layer keeps). Zero on every
    stage that keeps them, so their ``inner`` cost stays exact."""

    def __init__(self, inner: _MigrationBytes, fixed: dict[int, int], n: int) -> None:
        self.inner, self.fixed, self.positions = inner, fixed, np.arange(n + 1)

    def terms(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        end, start = self.inner.terms(stage)
        wrong = np.zeros(len(self.positions))
        for b, c in self.fixed.items():  # the layers before c belong to stages before b, the rest to b on
            wrong += self.positions.clip(min=c) - c if stage < b else self.positions.clip(max=c) - c
        return end + _WRONG_SIDE * wrong, start - _WRONG_SIDE * wrong


def _stage_of_layers(profile: GraphProfile, setup: PipelineSetup, cuts: Sequence[int]) -> np.ndarray:
    """The stage of each layer (in execution order) under a partition's ``cuts``."""
    return np.repeat(np.arange(setup.num_stages), np.diff([0, *cuts, profile.n]))


def _moves(profile: GraphProfile, setup: PipelineSetup, plan: Evaluated, current_stage: np.ndarray,
           per_hop: np.ndarray) -> tuple[int, float]:
    """How many layers ``plan`` moves from ``current_stage``, and the bytes their hops send."""
    hops = np.abs(_stage_of_layers(profile, setup, plan.cuts) - current_stage)
    return int(np.count_nonzero(hops)), float(np.sum(per_hop * hops))


def _per_hop_bytes(profile: GraphProfile, setup: PipelineSetup, current_stage: np.ndarray) -> np.ndarray:
    """What one neighbour hop of each layer sends: weights and optimizer state; for a stream (PipeDream,
    2BW) also the stashed weight versions and the inputs of its in-flight micro-batches."""
    hw = setup.hardware
    out = profile.params * (1.0 + hw.optimizer_factor)
    if streams(setup.schedule):  # of the stage it leaves: p - k in flight; p - k versions (PipeDream) or 2
        flight = setup.num_stages - current_stage
        versions = np.array([weight_versions(setup.schedule, int(k), setup.num_stages)
                             for k in current_stage])
        out = out + profile.params * (versions - 1) + flight * profile.in_bytes
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
        cooldown_steps: int = 10,
        method: str = "kl",
        allow_moves: bool = True,
        in_flight_counts: tuple[int, ...] | None = None,
        stage_ranks: tuple[int, ...] | None = None,
        stage_speeds: tuple[float, ...] | None = None,
    ) -> None:
        self.setup = PipelineSetup(num_stages, schedule, micro_batches, hardware or Hardware(),
                                   in_flight_counts=in_flight_counts, stage_ranks=stage_ranks,
                                   stage_speeds=stage_speeds)
        self.budgets = self.setup.budgets(memory_budget)
        if not (isinstance(horizon_steps, int) and horizon_steps >= 1):
            raise ValueError(f"horizon_steps must be a positive integer, got {horizon_steps!r}")
        if not (0.0 <= min_gain < 1.0):
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
        if not (isinstance(cooldown_steps, int) and cooldown_steps >= 0):
            raise ValueError(f"cooldown_steps must be a non-negative integer, got {cooldown_steps!r}")
        self.horizon_steps, self.min_gain, self.cooldown_steps = horizon_steps, min_gain, cooldown_steps
        self.method = check_method(method)
        self.allow_moves = allow_moves  # False: only the policies of the current partition change
        self.last_proposal_step: int | None = None
        # seconds per byte the last move really took (the ranks measure it); a move then costs at least that
        self.measured_s_per_byte: float | None = None

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
        if before is not None and before.fits and before.step_s - fastest_step(profile, setup) \
                < self.min_gain * before.step_s:
            return None  # no placement or policy can gain min_gain (a balanced pipeline that fits): no search
        best, _ = srp_loop(profile, setup, budgets, self.method)
        if before is not None and before.fits and before.step_s - best.step_s < self.min_gain * before.step_s:
            # even the best plan, moved for free, is inside the hysteresis band: stay (and skip the DPs)
            policies_only = optimize_stages(profile, setup, budgets, before.cuts)
            if before.step_s - policies_only.step_s < self.min_gain * before.step_s:
                return None
        now = None if before is None else before.cuts
        candidates = [c for c in self._candidates(profile, before, best, current)
                      if self._may_move(profile, c[0], c[1], placeable, now)]
        chosen = self._choose(before, candidates)
        if chosen is None:
            return None
        self.last_proposal_step = step
        return self._proposal(profile, current, before, chosen)

    def reprice(self, graph: LayerGraph, current: Plan, plan: Plan,
                placeable: Callable[[list[list[int]]], bool] | None = None) -> Proposal | None:
        """``plan``, an earlier proposal, judged on ``graph``'s statistics: a proposal again if it is still
        worth sending against ``current`` (the gain and the payback :meth:`propose` asks of a plan made
        for speed), else None. Starts no cooldown.
        """
        profile = GraphProfile(graph)
        before = self._current(profile, current)
        if before is None or not before.fits:
            return None  # the running plan cannot run: propose() fixes that, at once
        try:
            plan.check_against(profile.ids, self.setup.num_stages)
        except PlanError:
            return None  # layers changed since
        after = evaluate(profile, self.setup, self.budgets, profile.cuts_of(plan.stages),
                         profile.codes_from(plan.policies))
        current_stage = _stage_of_layers(profile, self.setup, before.cuts)
        moved, moved_bytes = _moves(profile, self.setup, after, current_stage,
                                    _per_hop_bytes(profile, self.setup, current_stage))
        if not self._may_move(profile, after, moved, placeable, before.cuts):
            return None
        chosen = self._choose(before, [(after, moved, moved_bytes)])
        return None if chosen is None else self._proposal(profile, current, before, chosen)

    def _may_move(self, profile: GraphProfile, plan: Evaluated, moved: int,
                  placeable: Callable[[list[list[int]]], bool] | None, now: Sequence[int] | None) -> bool:
        """A plan that moves layers needs moves on, stages that can build the layers arriving, and every
        boundary the schedule keeps fixed where it is now (``now``: the running plan's cuts)."""
        if moved == 0:
            return True
        fixed = self.setup.fixed_boundaries
        if fixed and (now is None or any(plan.cuts[b - 1] != now[b - 1] for b in fixed)):
            return False
        return self.allow_moves and (placeable is None or placeable(profile.stages_of(plan.cuts)))

    def _proposal(self, profile: GraphProfile, current: Plan, before: Evaluated | None,
                  chosen: tuple[Evaluated, int, float, str]) -> Proposal:
        plan, moved, moved_bytes, why = chosen
        migration_s = self.move_s(moved_bytes)
        before_step = before.step_s if before is not None else math.inf
        reason = (f"{why}: step {_ms(before_step)} -> {_ms(plan.step_s)} ms predicted, "
                  f"{moved} layer(s) move ({moved_bytes / 1e6:.1f} MB, {migration_s * 1e3:.1f} ms)")
        new_plan = Plan(epoch=current.epoch + 1, stages=tuple(tuple(s) for s in profile.stages_of(plan.cuts)),
                        policies=profile.policies_from(plan.codes), predicted_step_s=plan.step_s,
                        reason=reason)
        return Proposal(new_plan, before_step, plan.step_s, int(round(moved_bytes)), migration_s, moved,
                        reason,
                        tuple(float(t) for t in before.times) if before is not None else (),
                        tuple(float(t) for t in plan.times))

    # ----------------------------------------------------------------- internals
    def _current(self, profile: GraphProfile, current: Plan) -> Evaluated | None:
        """The running plan under the new statistics; None if it no longer covers the graph."""
        try:
            current.check_against(profile.ids, self.setup.num_stages)
        except PlanError:
            return None  # layers were added or removed: the old plan cannot run this graph
        cuts = profile.cuts_of(current.stages)
        return evaluate(profile, self.setup, self.budgets, cuts, profile.codes_from(current.policies))

    def _candidates(self, profile: GraphProfile, before: Evaluated | None, best: Evaluated,
                    current: Plan) -> list[tuple[Evaluated, int, float]]:
        """(plan, layers moved, bytes moved) for: policies only, the best plan, and the plans
        that move fewest bytes to reach bottlenecks between the best and the current one."""
        setup, budgets = self.setup, self.budgets
        if before is None:  # layers changed: only the surviving layers that change stage move
            old_stage = {lid: k for k, layers in enumerate(current.stages) for lid in layers}
            new_stage = _stage_of_layers(profile, setup, best.cuts)
            was = np.array([old_stage.get(lid, k) for lid, k in zip(profile.ids, new_stage)])
            hops = np.abs(new_stage - was)
            per_hop = _per_hop_bytes(profile, setup, was)
            return [(best, int(np.count_nonzero(hops)), float(np.sum(per_hop * hops)))]
        current_stage = _stage_of_layers(profile, setup, before.cuts)
        migration = _MigrationBytes(profile, setup, current_stage)
        out: list[tuple[Evaluated, int, float]] = []

        def add(plan: Evaluated) -> None:
            out.append((plan, *_moves(profile, setup, plan, current_stage, migration.per_hop)))

        add(optimize_stages(profile, setup, budgets, before.cuts))
        add(best)
        ceiling = before.bottleneck_s if before.fits else math.inf
        costs = StageCosts(profile, setup, best.codes)
        fixed = {b: before.cuts[b - 1] for b in setup.fixed_boundaries}
        secondary = _KeepBoundaries(migration, fixed, profile.n) if fixed else migration
        for slack in _TARGET_SLACK + (_KEPT_SLACK if fixed else ()):
            limit = best.bottleneck_s * (1 + slack)
            if limit >= ceiling:
                break
            if setup.uneven:
                lean = uneven_min_secondary(costs, setup.num_stages, limit, secondary, budgets,
                                            memory="best_case")
            else:
                lean = min_secondary(costs, setup.num_stages, limit, secondary, budgets, memory="best_case")
            if lean is not None:
                add(optimize_stages(profile, setup, budgets, lean.cuts))
        return out

    def move_s(self, moved_bytes: float) -> float:
        """What moving ``moved_bytes`` costs: the link's time, or
        what the last move measured if that was more."""
        linked = moved_bytes / self.setup.hardware.net_bytes_per_s
        return max(linked, moved_bytes * self.measured_s_per_byte) if self.measured_s_per_byte else linked

    def _choose(self, before: Evaluated | None,
                candidates: list[tuple[Evaluated, int, float]]) -> tuple[Evaluated, int, float, str] | None:
        feasible = [c for c in candidates if c[0].fits]
        if not feasible:
            return None
        if before is None or not before.fits:
            # the running plan cannot run (layers changed) or overflows memory: fix it
            base = before.step_s if before is not None else max(c[0].step_s for c in feasible)
            plan, moved, moved_bytes = max(
                feasible, key=lambda c: (self.horizon_steps * (base - c[0].step_s) - self.move_s(c[2]),
                                         -c[2]))
            why = "layers changed" if before is None else "memory over budget"
            return plan, moved, moved_bytes, why
        worthwhile = []
        for plan, moved, moved_bytes in feasible:
            gain = before.step_s - plan.step_s
            benefit = self.horizon_steps * gain - self.move_s(moved_bytes)
            if gain >= self.min_gain * before.step_s and benefit > 0:
                worthwhile.append((benefit, -moved_bytes, plan, moved, moved_bytes))
        if not worthwhile:
            return None
        _, _, plan, moved, moved_bytes = max(worthwhile, key=lambda w: (w[0], w[1]))
        return plan, moved, moved_bytes, ("policies" if moved == 0 else "rebalance")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if math.isfinite(seconds) else "inf"


def placeable_partitions(vector: Sequence[StageRecord], current: Plan) -> Callable[[list[list[int]]], bool]:
    """Whether every layer a partition moves can be built by each stage it arrives on (hops included), and
    may move at all (a pinned block never does)."""
    kinds = {lr.layer_id: lr.kind for rec in vector for lr in rec.layers}
    builds = [None if rec.builds is None else set(rec.builds) for rec in vector]
    now = {lid: s for s, layers in enumerate(current.stages) for lid in layers}

    def placeable(stages: list[list[int]]) -> bool:
        for dst, layers in enumerate(stages):
            for lid in layers:
                src = now.get(lid, dst)
                step = 1 if dst > src else -1
                if dst != src and kinds.get(lid, "").endswith(PINNED_KIND):
                    return False
                for hop in range(src + step, dst + step, step) if dst != src else ():
                    allowed = builds[hop]
                    if allowed is not None and kinds.get(lid, "") not in allowed:
                        return False
        return True

    return placeable
