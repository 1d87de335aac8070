"""What taking effect means for a plan on one rank: moves, then one commit of the plan in force.

Every rank applies the same plans in the same order at the same step (see
:mod:`vpipe.rank.boundary`), so every rank skips the same ones: an older epoch, a plan
made for another set of layers (edited since), or one that does not fit the pipeline (the
one check, :meth:`~vpipe.rank.plan_in_force.PlanInForce.check`). A plan that moves layers
on a rank whose stages cannot move them (a traced split) applies its policies only. Moves
go through the layer manager, which trusts the plan checked here: at the step boundary for
the flush schedules, streamed into a PipeDream stream (one round of neighbour hops per
step). The moves start from the plan in force's placement and return the one they reached;
then the plan is committed once, with that placement: the tensor
managers take its policies (the layers that arrived included) and budgets, the layer
manager, agent and monitors its epoch.
"""

from __future__ import annotations

import logging
import time

from vpipe.log import decision
from vpipe.plan import Plan, PlanError
from vpipe.rank.parts import RankParts

log = logging.getLogger("vpipe.attach")

__all__ = ["PlanApplier"]


class PlanApplier:
    """Applies plans to this rank's layer manager and commits them to the plan in force."""

    def __init__(self, parts: RankParts, move_refusal: str | None) -> None:
        self.parts = parts
        self.move_refusal = move_refusal
        self.streamed_rest: Plan | None = None  # a PipeDream plan whose next round of hops is still to come
        self.streams = parts.engine.streams  # moves streamed into the schedule, a round of hops per step
        # a stream numbers its micro-batches from its first step: those it ran before attach come first
        # (only where blocks may move; WPipe's count G0's: a period's j-th is period * m + j)
        self.first_mb = parts.engine.stream.next_forward if self.streams and move_refusal is None else 0

    def apply(self, plan: Plan, step: int, micro_batches: int) -> None:
        lm, owner, pipeline = self.parts.layer_manager, self.parts.plan_in_force, self.parts.pipeline
        who = pipeline.first.index
        if owner.stale(plan):
            log.info("stage %d: skipping stale plan epoch %d", who, plan.epoch)
            return
        if sorted(plan.layer_ids) != sorted(owner.order):
            decision("plan_skipped",
                     f"epoch {plan.epoch}: made for another set of layers (they were edited since)",
                     epoch=plan.epoch, stage=who)
            return
        try:  # every rank holds the same order, so every rank skips the same plans
            owner.check(plan, owner.order, lm.num_stages)
        except PlanError as e:
            decision("plan_skipped", f"epoch {plan.epoch}: {e}", epoch=plan.epoch, stage=who)
            return
        reached = owner.placement
        moves = [list(s) for s in plan.stages] != [list(s) for s in reached]
        refusal = self.parts.engine.plan_refusal(reached, plan.stages) if moves else None
        if refusal is not None:  # a boundary the engine keeps fixed: the plan is skipped whole, on every rank
            decision("plan_skipped", f"epoch {plan.epoch}: {refusal}", epoch=plan.epoch, stage=who)
            return
        if moves and self.move_refusal is not None:
            decision("plan_skipped", f"epoch {plan.epoch}: layers cannot move ({self.move_refusal}); "
                     "applied policies only", epoch=plan.epoch, stage=who)
        elif moves and self.streams:
            switch = self.first_mb + step * micro_batches
            reached = lm.start_streamed(plan, reached, self.parts.engine.stream, switch_mb=switch)[1]
            if [list(s) for s in reached] != [list(s) for s in plan.stages]:
                self.streamed_rest = plan  # a two-hop move: its next round follows when this one is done
        elif moves:
            started = time.perf_counter()
            report = lm.apply(plan, reached)
            reached = report.placement
            if report.rebuilt:
                self.parts.engine.reset_shapes()
            session = self.parts.session
            for monitor in session.monitors.values() if session is not None else ():  # the next sample tells
                monitor.move_s = time.perf_counter() - started
        # the layers are where the moves took them (all, some, or none where a move aborted)
        owner.commit(Plan(epoch=plan.epoch, stages=reached, policies=plan.policies,
                          predicted_step_s=plan.predicted_step_s, reason=plan.reason,
                          stage_speeds=plan.stage_speeds), "applied")
        for v in lm.local_stages:
            decision("plan_applied", f"epoch {plan.epoch} takes effect at step {step}", epoch=plan.epoch,
                     stage=v,
                     step=step, layers=lm.layers_of(v),
                     policies={str(lid): plan.policy(lid).value for lid in lm.layers_of(v)})

    def continue_streamed(self, step: int, micro_batches: int) -> None:
        """Start the next round of a PipeDream plan's hops once the previous round is done (the plan took
        effect, checked, when its first round started)."""
        plan = self.streamed_rest
        pipeline = self.parts.pipeline
        if plan is None or any(not m.done for m in pipeline.schedule.movers):
            return
        self.streamed_rest = None
        owner = self.parts.plan_in_force
        reached = self.parts.layer_manager.start_streamed(plan, owner.placement, pipeline.schedule,
                                                          switch_mb=self.first_mb + step * micro_batches)[1]
        owner.reached(reached)
        if [list(s) for s in reached] != [list(s) for s in plan.stages]:
            self.streamed_rest = plan
