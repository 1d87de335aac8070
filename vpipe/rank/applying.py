"""What taking effect means for a plan on one rank: policies, moves, and the bookkeeping after them.

Every rank applies the same plans in the same order at the same step (see
:mod:`vpipe.rank.boundary`), so every rank skips the same ones: a plan made for another set
of layers (edited since), one that does not fit the pipeline, or an older epoch. A plan
that moves layers on a rank whose stages cannot move them (a traced split) applies its
policies only. Moves go through the layer manager: at the step boundary for the flush
schedules, streamed into a PipeDream stream (one round of neighbour hops per step).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from vpipe.control.session import ControlSession
from vpipe.log import decision
from vpipe.migration.layer_manager import LayerManager
from vpipe.plan import Plan, PlanError
from vpipe.rank.memory import StageMemory, apply_budgets
from vpipe.stage.pipeline import Pipeline, reset_shape_inference

log = logging.getLogger("vpipe.attach")

__all__ = ["PlanApplier"]


class PlanApplier:
    """Applies plans to this rank's layer manager, tensor managers and session."""

    def __init__(self, pipeline: Pipeline, layer_manager: LayerManager, tensor_managers: Mapping[int, Any],
                 session: ControlSession, memories: Mapping[int, StageMemory], move_refusal: str | None) -> None:
        self.pipeline = pipeline
        self.layer_manager = layer_manager
        self.tensor_managers = tensor_managers
        self.session = session
        self.memories = memories
        self.move_refusal = move_refusal
        self.streamed_rest: Plan | None = None  # a PipeDream plan whose next round of hops is still to come
        self.pipedream = pipeline.kind == "pipedream"

    def apply(self, plan: Plan, step: int, micro_batches: int) -> None:
        lm = self.layer_manager
        who = self.pipeline.first.index
        if plan.epoch <= lm.epoch:
            log.info("stage %d: skipping stale plan epoch %d", who, plan.epoch)
            return
        if sorted(plan.layer_ids) != sorted(lm.order):
            decision("plan_skipped", f"epoch {plan.epoch}: made for another set of layers (they were edited since)",
                     epoch=plan.epoch, stage=who)
            return
        try:  # every rank holds the same order, so every rank skips the same plans
            plan.check_against(lm.order, lm.num_stages)
        except PlanError as e:
            decision("plan_skipped", f"epoch {plan.epoch}: {e}", epoch=plan.epoch, stage=who)
            return
        self._set_policies(plan)
        moves = [list(s) for s in plan.stages] != [list(s) for s in lm.placement]
        if moves and self.move_refusal is not None:
            decision("plan_skipped", f"epoch {plan.epoch}: layers cannot move ({self.move_refusal}); "
                     "applied policies only", epoch=plan.epoch, stage=who)
            lm.epoch = plan.epoch
        elif moves and self.pipedream:
            lm.start_streamed(plan, self.pipeline.schedule, switch_mb=step * micro_batches)
            if [list(s) for s in lm.placement] != [list(s) for s in plan.stages]:
                self.streamed_rest = plan  # a two-hop move: its next round follows when this one is done
        elif moves:
            report = lm.apply(plan)
            if report.rebuilt and self.pipeline.schedule is not None:
                reset_shape_inference(self.pipeline.schedule)
        else:
            lm.epoch = plan.epoch
        self._set_policies(plan)  # the layers that arrived
        self.session.agent.plan = Plan(epoch=plan.epoch, stages=lm.placement, policies=plan.policies,
                                       predicted_step_s=plan.predicted_step_s, reason=plan.reason)
        self.session.set_epoch(plan.epoch)
        for v in lm.local_stages:
            decision("plan_applied", f"epoch {plan.epoch} takes effect at step {step}", epoch=plan.epoch, stage=v,
                     step=step, layers=lm.layers_of(v),
                     policies={str(lid): plan.policy(lid).value for lid in lm.layers_of(v)})

    def _set_policies(self, plan: Plan) -> None:
        lm = self.layer_manager
        for v, manager in self.tensor_managers.items():
            manager.set_policies({lid: plan.policy(lid) for lid in lm.layers_of(v)})
        apply_budgets(self.tensor_managers, self.memories, lm.epoch)

    def continue_streamed(self, step: int, micro_batches: int) -> None:
        """Start the next round of a PipeDream plan's hops once the previous round is done."""
        plan = self.streamed_rest
        if plan is None or any(not m.done for m in self.pipeline.schedule.movers):
            return
        self.streamed_rest = None
        lm = self.layer_manager
        lm.start_streamed(plan, self.pipeline.schedule, switch_mb=step * micro_batches, continuation=True)
        if [list(s) for s in lm.placement] != [list(s) for s in plan.stages]:
            self.streamed_rest = plan
