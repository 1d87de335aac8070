"""The plan in force on one rank: its one owner, and the parts that follow it.

A plan is in force from the step boundary it took effect at until the next one takes
over: its epoch, where the layers are (its ``stages``: the rank's placement, kept nowhere
else), and each layer's policy. :class:`PlanInForce` holds it, checks a plan once before it
may take effect, and is the only place that assigns it: :meth:`PlanInForce.commit`. The layer
manager is handed the placement to move or edit layers from and returns the one it reached,
which the caller commits; a streamed PipeDream plan's later rounds of hops record theirs
with :meth:`PlanInForce.reached` (same plan, same epoch). The parts that keep a copy (the
layer manager's epoch, the agent's plan and the monitors' epoch behind the control session,
the tensor managers' policies and their budgets) are told, in the order they were
registered at construction, through one interface, :class:`PlanListener`.

Three things make a plan take effect, and the listeners may tell them apart (``cause``):
a plan applied at a step boundary (``"applied"``), a layer edit that starts a new epoch
over the changed layers with the policies carried over (``"edited"``), and a checkpoint's
plan (``"restored"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal, Protocol

from vpipe.plan import Plan
from vpipe.rank.memory import StageMemory, apply_budgets
from vpipe.tensor_manager import TensorManager

__all__ = ["Cause", "PlanListener", "PlanInForce", "StagePolicies"]

Cause = Literal["applied", "edited", "restored"]


class PlanListener(Protocol):
    """A part that keeps a copy of the plan in force (or of its epoch) and is told when it changes."""

    def plan_changed(self, plan: Plan, cause: Cause) -> None: ...


class PlanInForce:
    """The one owner of the plan in force on this rank.

    ``listeners`` are told of every commit, in this order; they are fixed at construction.
    Every rank commits the same plans at the same step boundaries (see
    :mod:`vpipe.rank.boundary`), so every rank holds the same epoch.
    """

    def __init__(self, initial: Plan, listeners: Sequence[PlanListener]) -> None:
        self._plan = initial
        self._listeners = tuple(listeners)

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def epoch(self) -> int:
        return self._plan.epoch

    @property
    def placement(self) -> tuple[tuple[int, ...], ...]:
        """Where every layer of the model is now: layer ids per stage, in model order."""
        return self._plan.stages

    @property
    def order(self) -> list[int]:
        """Every layer of the model, in execution order."""
        return [lid for layers in self._plan.stages for lid in layers]

    def stale(self, plan: Plan) -> bool:
        """Whether ``plan`` is not newer than the plan in force (every rank skips it alike)."""
        return plan.epoch <= self._plan.epoch

    def check(self, plan: Plan, layer_order: Sequence[int], num_stages: int) -> None:
        """Raise :class:`~vpipe.plan.PlanError` for a plan that does not place exactly ``layer_order`` on
        ``num_stages`` stages as contiguous runs: the one check a plan passes before it takes effect (and a
        trainer's forced plan when it is requested)."""
        plan.check_against(layer_order, num_stages)

    def commit(self, plan: Plan, cause: Cause) -> None:
        """``plan`` is in force from now on: the one assignment, then every listener is told."""
        self._plan = plan
        for listener in self._listeners:
            listener.plan_changed(plan, cause)

    def reached(self, stages: Sequence[Sequence[int]]) -> None:
        """A streamed plan's next round of hops took the layers to ``stages``: the same plan
        stays in force, and no listener is told (they were when its first round started;
        DeepSpeed's, which follows the placement, never streams)."""
        self._plan = replace(self._plan, stages=tuple(tuple(s) for s in stages))


class StagePolicies:
    """The tensor managers' side of the plan in force: the policies of their layers, then their budgets.

    An edit carries the policies over (the managers keep running what they run, escalations
    included), so it sets none; a restored plan sets them, and leaves the budgets to the next
    step boundary, as every boundary gives them.
    """

    def __init__(self, tensor_managers: Mapping[int, TensorManager],
                 memories: Mapping[int, StageMemory]) -> None:
        self.tensor_managers = tensor_managers
        self.memories = memories

    def plan_changed(self, plan: Plan, cause: Cause) -> None:
        if cause != "edited":
            for manager in self.tensor_managers.values():
                manager.apply_plan(plan)
        if cause != "restored":
            apply_budgets(self.tensor_managers, self.memories, plan.epoch)
