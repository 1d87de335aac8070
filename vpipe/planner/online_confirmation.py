"""When the online planner sends a plan for speed: only once it was worth sending on several samples in a row.

One noisy sample on a busy machine must not move layers, and two near-equal plans that noise makes the
searches alternate between must not stall the pipeline either. :class:`ProposalConfirmation` is the online
planner's memory of what its last searches proposed (and since which step), kept apart from the statistics
it smooths: it decides, for each proposal, whether it goes now or waits for the next sample, and forgets
what it waits for when a rank's pulse says the devices changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vpipe.plan import Plan
from vpipe.planner.online_config import OnlineConfig
from vpipe.planner.proposals import Proposal

log = logging.getLogger("vpipe.planner.online")

__all__ = ["ProposalConfirmation", "known_change"]

_AT_ONCE = ("memory", "layers changed")  # proposals that are not confirmed first: the current plan cannot run


def _plan_key(plan: Plan) -> tuple[Any, ...]:
    """What makes two proposals the same plan: placement and policies (not the epoch or the reason)."""
    return (plan.stages, tuple(sorted((lid, pol.value) for lid, pol in plan.policies.items())))


def known_change(froze: bool, now: tuple[float, ...] | None, before: tuple[float, ...] | None) -> bool:
    """Whether the imbalance comes from a change that is known, not guessed: blocks froze (a pulse counted
    trainable parameters), or a stage's factor (``now``) is 25% off what it was when the last plan went
    (``before``; the samples that name a factor agree already). The plan for it then goes without waiting
    for another search."""
    now = now or ()
    before = before or (1.0,) * len(now)
    return froze or len(before) != len(now) or any(abs(a / b - 1.0) > 0.25 for a, b in zip(now, before))


class ProposalConfirmation:
    """The proposals of an online planner's last searches, and whether the newest goes now."""

    def __init__(self, config: OnlineConfig) -> None:
        self.config = config
        # what the last searches proposed: (its key, how many samples in a row found it worth sending, the
        # plan, the step of the sample that first proposed it)
        self._proposed: tuple[Any, int, Plan, int] | None = None

    @property
    def waiting(self) -> bool:
        """Whether a proposal waits for the next sample to confirm it."""
        return self._proposed is not None

    def drop(self) -> None:
        """Nothing to gain now: a later proposal starts its count again."""
        self._proposed = None

    def drop_before(self, since: int) -> None:
        """Forget a proposal first made before step ``since`` (made on what the devices were then)."""
        if self._proposed is not None and self._proposed[3] < since:
            self._proposed = None

    def confirmed(self, proposal: Proposal, iteration: int, *, at_once: bool,
                  reprice: Callable[[Plan], Proposal | None]) -> Proposal | None:
        """The proposal to send now, or None to wait for the next sample.

        A plan that fits memory or follows a layer edit goes at once (``at_once``: the stages report layers
        the planner did not place, a known change and not noise). A plan for speed goes once it was worth
        sending on ``confirm_samples`` samples in a row: proposed by each search, or proposed by an earlier
        one and still worth sending on the new statistics (``reprice``). Near-equal plans that noise makes the
        searches alternate between are one imbalance seen twice: the earlier of them goes, unless the newer
        one is better on the newest statistics by more than ``min_gain`` (the imbalance is larger than the
        first sample showed: moving part of the way would need a second move).
        """
        if at_once or proposal.reason.startswith(_AT_ONCE) or self.config.confirm_samples <= 1:
            self._proposed = None
            return proposal
        key = _plan_key(proposal.plan)
        earlier = self._proposed
        if earlier is not None and earlier[0] != key:
            again = reprice(earlier[2])
            if again is not None and proposal.after_step_s < again.after_step_s - self.config.min_gain * \
                    again.before_step_s:
                # the same imbalance, a better plan for it
                earlier = (key, earlier[1], proposal.plan, earlier[3])
            elif again is not None:
                proposal, key = again, earlier[0]
        seen = earlier[1] + 1 if earlier is not None and earlier[0] == key else 1
        if seen < self.config.confirm_samples:
            self._proposed = (key, seen, proposal.plan, earlier[3] if seen > 1 and earlier else iteration)
            log.info("planner: iteration %d proposes %s (%d of %d searches in a row); "
                     "waiting for the next sample",
                     iteration, proposal.reason, seen, self.config.confirm_samples)
            return None
        self._proposed = None
        return proposal
