"""Judging a plan by the steps that follow it: one that made them slower is reverted.

The planner's predictions come from a cost model; the step times the stages measure after a plan takes
effect are the truth. The planner daemon hands every stats vector to a :class:`PlanJudge` before it plans.
The judge remembers the step times measured under the running plan; once a new plan has run for
``after_samples`` sampled steps, it compares their median with the median of the last ``before_samples``
under the plan it replaced (medians of three: one slow sample, a busy moment, moves neither; the first
sample of each plan is not counted, as it carries the warm-up or a move's one-off costs, unless it is all
there is: a plan sent right after the devices changed is judged against that first sample, an overestimate
that can only keep a plan, where judging nothing let a bad one stay for good). When the new one is slower
by more than ``tolerance`` and every step after it was slower than every step before (on busy or shared
devices steps vary by a third: a difference inside that spread is noise, and reverting on it undoes good
plans), the judge returns the earlier placement and policies as a new plan (``plan_reverted`` in the log,
with both step times), and refuses that plan from then on.

What is measured is a sampled step's time on each stage; the pipeline's step is its
slowest stage's. Plans made to fit memory or to follow a layer edit ("memory ...",
"layers changed ...") are never reverted: the plan before them could not run; nor are plans
that change nothing (a new epoch of the same placement and policies). A layer
edit while a plan is judged ends the judging (the step time changed for another reason).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from vpipe.log import decision
from vpipe.monitors.records import StageRecord
from vpipe.plan import Plan

__all__ = ["PlanJudge"]

_NOT_JUDGED = ("memory", "layers changed", "revert")
DEVICES_CHANGED = 2.0  # a stage's forward time changed this much (either way): the devices changed, not noise


@dataclass
class _Trial:
    plan: Plan
    replaced: Plan
    before_s: list[float]
    after_s: list[float]


class PlanJudge:
    """Measured step times before and after each plan; a revert plan when one made steps slower."""

    def __init__(self, *, before_samples: int = 3, after_samples: int = 3, tolerance: float = 0.10) -> None:
        if before_samples < 1 or after_samples < 1 or tolerance < 0:
            raise ValueError("before_samples and after_samples must be >= 1, tolerance >= 0")
        self.before_samples = before_samples
        self.after_samples = after_samples
        self.tolerance = tolerance
        self._recent: deque[float] = deque(maxlen=before_samples)
        self._recent_epoch: int | None = None
        self._recent_signature: tuple[object, ...] | None = None
        self._first: float | None = None  # the plan's first sample (one-off costs included), not in _recent
        self._trial: _Trial | None = None
        self._refused: set[tuple[object, ...]] = set()
        self.reverted = 0

    def observe(self, vector: Sequence[StageRecord], current: Plan | None) -> Plan | None:
        """Take a stats vector; a plan that undoes ``current`` when it proved slower, else None."""
        epochs = {rec.epoch for rec in vector}
        if len(epochs) != 1 or not vector:
            return None  # measured across a plan change: belongs to neither side
        epoch = epochs.pop()
        step_s = max(rec.step_s for rec in vector)
        # its first sample carries one-off costs (warm-up, a move's aftermath)
        if epoch != self._recent_epoch:
            known = current is not None and current.epoch == epoch
            if not known or _signature(current) != self._recent_signature:  # type: ignore[arg-type]
                self._recent.clear()  # a re-measure (the same placement, a new epoch) keeps what was measured
            self._recent_epoch = epoch
            self._recent_signature = _signature(current) if known else None  # type: ignore[arg-type]
            self._first = step_s
            return None
        trial = self._trial
        if trial is not None:
            if epoch > trial.plan.epoch:
                self._trial = None  # a layer edit (or another plan) came in between: no verdict
            elif epoch == trial.plan.epoch:
                trial.after_s.append(step_s)
                if len(trial.after_s) >= self.after_samples:
                    self._trial = None
                    revert = self._verdict(trial, current, vector[-1].iteration)
                    if revert is not None:
                        return revert
        self._recent.append(step_s)
        return None

    def forget(self) -> None:
        """The devices changed (a straggler came or went): step times measured before say nothing about the
        plan on trial now. Plans refused stay refused (a plan that made steps slower is never sent again)."""
        self._trial = None
        self._recent.clear()
        self._recent_epoch = self._recent_signature = self._first = None

    def remeasured(self, plan: Plan, ratio: float) -> None:
        """A rank's pulse saw its stage's forward time change by ``ratio``, and ``plan`` (the
        placement in force, a new epoch) has every rank measure again. A plan on trial goes on being
        judged under the new epoch (on busy cores the pulse fires every few steps; forgetting the
        trial let a bad plan stay); after a change of :data:`DEVICES_CHANGED` or more, either way, on
        the steps from now on. Without a trial, such a change is the devices': what was measured
        before says nothing of later plans (:meth:`forget`)."""
        big = not ratio > 0 or abs(math.log(ratio)) >= math.log(DEVICES_CHANGED)
        if self._trial is not None and _signature(self._trial.plan) == _signature(plan):
            self._trial.plan = plan
            if big:
                self._trial.after_s.clear()
        elif big:
            self.forget()

    def refuses(self, plan: Plan) -> bool:
        """Whether ``plan`` places and keeps the layers as a plan that was reverted did."""
        return _signature(plan) in self._refused

    def sent(self, plan: Plan, replaced: Plan | None) -> None:
        """A plan went to the stages: judge it against the steps measured under ``replaced``."""
        before = list(self._recent) or ([self._first] if self._first is not None else [])
        if replaced is None or not before or (self._recent_epoch != replaced.epoch
                                              and self._recent_signature != _signature(replaced)) \
                or plan.reason.startswith(_NOT_JUDGED) or _signature(plan) == _signature(replaced):
            self._trial = None
            return
        self._trial = _Trial(plan, replaced, before, [])

    def _verdict(self, trial: _Trial, current: Plan | None, iteration: int) -> Plan | None:
        before = statistics.median(trial.before_s)
        after = statistics.median(trial.after_s)
        if before <= 0 or after <= before * (1 + self.tolerance) or min(trial.after_s) <= max(trial.before_s):
            return None
        if current is None or current.epoch != trial.plan.epoch:
            return None  # another plan is already on its way
        self._refused.add(_signature(trial.plan))
        self.reverted += 1
        old = trial.replaced
        revert = Plan(epoch=current.epoch + 1, stages=old.stages, policies=old.policies,
                      predicted_step_s=before,
                      reason=(f"revert epoch {trial.plan.epoch}: measured "
                              f"{after * 1e3:.2f} ms/step after it, {before * 1e3:.2f} ms/step before"))
        decision("plan_reverted", f"epoch {trial.plan.epoch} made steps slower ({before * 1e3:.2f} -> "
                 f"{after * 1e3:.2f} ms measured); back to the plan of epoch {old.epoch} as "
                 f"epoch {revert.epoch}",
                 role="planner", epoch=trial.plan.epoch, revert_epoch=revert.epoch, iteration=iteration,
                 step_s_before=before, step_s_after=after, samples_before=trial.before_s,
                 samples_after=trial.after_s, predicted_step_s=trial.plan.predicted_step_s)
        return revert


def _signature(plan: Plan) -> tuple[object, ...]:
    return (plan.stages, tuple(sorted((lid, pol.value) for lid, pol in plan.policies.items()
                                      if pol.value != "D")))
