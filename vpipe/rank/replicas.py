"""Data-parallel replicas of one pipeline: they must hold the same blocks on the same stage at every step.

When the pipeline's process group is one dimension of a mesh, the other ranks run replicas
of the same pipeline whose gradients the trainer all-reduces over the data-parallel group.
vpipe keeps them alike with the simplest sound design: the *leading* replica (the pipeline
that holds world rank 0) runs the planner, from its own statistics; its stage 0, which
schedules every plan for its pipeline, also publishes the plan and its step in the job's
shared namespace, and every other replica applies exactly that plan at exactly that step.
The move's vote runs over the whole world, so a replica that cannot apply a plan makes every
replica skip it.

Causality makes the hand-out exact, as for one pipeline: the trainer's gradient all-reduce
of step ``t-1`` ties every rank of a follower to the leader's rank of the same stage, which
ran step ``t-1`` only after the leader's stage 0 wrote the key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vpipe.plan import Plan
from vpipe.rank.agreement import StoreAgreement

__all__ = ["ReplicaPlans", "Replicas", "check_replicas_alike"]

_PLAN_KEY = "plan/{}"
_LAYOUT_KEY = "layout/"


@dataclass(frozen=True)
class Replicas:
    """Where this rank's pipeline stands among the job's replicas."""

    world_ranks: tuple[int, ...]  # the world rank of every rank of this pipeline's group
    world_size: int

    @property
    def count(self) -> int:
        return self.world_size // len(self.world_ranks)

    @property
    def leads(self) -> bool:
        """The leading replica (the one that holds world rank 0) plans for all."""
        return 0 in self.world_ranks

    @property
    def name(self) -> str:
        """This pipeline's store namespace ("" for a pipeline over the whole world)."""
        return "" if self.count == 1 else f"pipeline-{self.world_ranks[0]}/"


def check_replicas_alike(agreement: StoreAgreement, *, world_rank: int, world_size: int,
                         layout: dict[str, Any], who: str) -> None:
    """Every replica must run the same pipeline (stages, schedule, blocks), or their reductions mix layers."""
    agreement.job.set(_LAYOUT_KEY + str(world_rank), json.dumps(layout, sort_keys=True))
    seen = [json.loads(raw) for raw in agreement.gather(_LAYOUT_KEY + "{}", range(world_size), "vpipe.attach", who,
                                                        store=agreement.job)]
    differ = [r for r, other in enumerate(seen) if other != json.loads(json.dumps(layout))]
    if differ:
        raise ValueError(f"vpipe.attach on {who}: world rank(s) {differ} run another pipeline ({seen[differ[0]]} vs "
                         f"{layout}); every data-parallel replica must run the same stages, schedule and blocks")


class ReplicaPlans:
    """The plans the leading replica scheduled, in the job's shared namespace, in order."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self._published = 0
        self._read = 0

    def publish(self, plan: Plan, at: int) -> None:
        """The leader's deciding rank: ``plan`` applies before step ``at`` on every replica."""
        self._published += 1
        self.job.set(_PLAN_KEY.format(self._published), json.dumps({"at": at, "plan": plan.to_wire()}))

    def fetch(self) -> Sequence[tuple[Plan, int]]:
        """The plans published since the last call, with their step (never waits)."""
        new = []
        while self.job.check([_PLAN_KEY.format(self._read + 1)]):
            self._read += 1
            body = json.loads(self.job.get(_PLAN_KEY.format(self._read)))
            new.append((Plan.from_wire(body["plan"]), int(body["at"])))
        return new
