"""When a plan takes effect: at the same step boundary on every rank.

Plans reach the ranks at different times (they travel rank by rank, from the last to the
first). All ranks must apply a plan at the same step, so rank 0 (the last to receive it)
decides the step and writes it to the rendezvous store; a rank holding a pending plan
reads that key at each step boundary. Causality makes this exact: rank k cannot start step
``t`` before rank 0's forwards of step ``t-1``, which rank 0 starts only after writing the key.

A PipeDream stream does not flush, so a rank may finish step ``t+1`` before rank 0 ends
step ``t``: one step more makes the key visible everywhere by the boundary that registers
it, and a streamed move registers one step ahead and switches at the first micro-batch of
the next step (:attr:`PlanBoundary.applying_step`).

Data-parallel replicas of the pipeline (:mod:`vpipe.rank.replicas`) apply the plans the
leading replica's stage 0 schedules: it publishes each with its step, and a follower's
boundary takes them from there instead of from a planner of its own.
"""

from __future__ import annotations

from vpipe.log import decision
from vpipe.plan import Plan
from vpipe.rank.agreement import StoreAgreement
from vpipe.rank.replicas import ReplicaPlans

__all__ = ["PlanBoundary"]

_APPLY_KEY = "apply/{}"


class PlanBoundary:
    """Pending plans, forced plans, and the step each takes effect at."""

    def __init__(self, agreement: StoreAgreement, *, decides: bool, lag_steps: int, streamed: bool,
                 who: str, replicas: ReplicaPlans | None = None, follows: bool = False) -> None:
        self.agreement = agreement
        self.decides = decides  # rank 0: the last to receive a plan schedules it for everyone
        self.replicas = replicas  # with data-parallel replicas: the leader publishes there, followers read it
        self.follows = follows  # a replica that applies the leading replica's plans
        self._follow_at: dict[int, int] = {}
        self.lag_steps = lag_steps
        self.streamed = streamed
        self.who = who
        self._pending: dict[int, Plan] = {}
        self._forced: dict[int, list[Plan]] = {}

    def applying_step(self, iteration: int) -> int:
        """The step whose start the plans applied at this boundary take effect at."""
        return iteration + 1 if self.streamed else iteration

    def received(self, plans: list[Plan], iteration: int, current_epoch: int) -> None:
        """Plans that arrived with the last step; rank 0 schedules each for every rank."""
        for plan in plans:
            if plan.epoch <= current_epoch or plan.epoch in self._pending:
                continue
            self._pending[plan.epoch] = plan
            if self.decides:
                at = iteration + self.lag_steps + (1 if self.streamed else 0)
                self.agreement.set(_APPLY_KEY.format(plan.epoch), str(at))
                if self.replicas is not None:
                    self.replicas.publish(plan, at)
                decision("plan_scheduled", f"epoch {plan.epoch} will apply before step {at}",
                         epoch=plan.epoch,
                         step=at)

    def request(self, plan: Plan, at_step: int, iteration: int) -> None:
        """Apply ``plan`` before step ``at_step`` (forced moves; every rank must request it identically)."""
        if at_step < self.applying_step(iteration):
            raise ValueError(f"step {at_step} is too early: this rank applies plans from step "
                             f"{self.applying_step(iteration)} on")
        self._forced.setdefault(at_step, []).append(plan)

    def due(self, iteration: int) -> list[Plan]:
        """The plans that take effect at this boundary, oldest first."""
        now = self.applying_step(iteration)
        due = list(self._forced.pop(now, []))
        if self.follows and self.replicas is not None:
            for plan, at in self.replicas.fetch():
                self._pending[plan.epoch] = plan
                self._follow_at[plan.epoch] = at
        for epoch in sorted(self._pending):
            value = (self._follow_at.get(epoch) if self.follows
                     else self.agreement.get(_APPLY_KEY.format(epoch)))
            if value is None:
                continue
            at = int(value)
            if at > now:
                continue
            if at < now:
                raise RuntimeError(f"{self.who}: plan epoch {epoch} was due at step {at} but "
                                   f"this stage only saw the decision at step {now}")
            due.append(self._pending.pop(epoch))
        return due
