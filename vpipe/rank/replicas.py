"""Data-parallel replicas of one pipeline: they must hold the same blocks on the same stage at every step.

When the pipeline's process group is one dimension of a mesh, the other ranks run replicas
of the same pipeline whose gradients the trainer all-reduces over the data-parallel group.
vpipe keeps them alike with the simplest sound design: the *leading* replica (the pipeline
that holds world rank 0) runs the planner; its stage 0, which
schedules every plan for its pipeline, also publishes the plan and its step in the job's
shared namespace, and every other replica applies exactly that plan at exactly that step.
The move's vote runs over the whole world, so a replica that cannot apply a plan makes every
replica skip it.

The planner sees every replica: at each sampled step a follower's rank publishes its stages'
records, and the leader's rank of the same stages takes, per stage, the record of the
*slowest* replica (most forward plus backward seconds) with the memory readings of the
*fullest* (the largest of each), before its records go down the chain to the planner.

Causality makes the hand-out exact, as for one pipeline: the trainer's gradient all-reduce
of step ``t-1`` ties every rank of a follower to the leader's rank of the same stage, which
ran step ``t-1`` only after the leader's stage 0 wrote the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vpipe.monitors.records import StageRecord
from vpipe.plan import Plan
from vpipe.rank.agreement import StoreAgreement

log = logging.getLogger("vpipe.attach")

__all__ = ["ReplicaPlans", "ReplicaStats", "Replicas", "check_replicas_alike", "slowest_and_fullest"]

_PLAN_KEY = "plan/{}"
_LAYOUT_KEY = "layout/"
_STATS_KEY = "stats/{}/{}"  # iteration, world rank
_FIRST_KEY = "first/"
_MEMORY_FIELDS = ("device_resident_bytes", "device_peak_bytes", "host_rss_bytes", "host_pool_used_bytes",
                  "host_pool_peak_bytes")


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
                         layout: dict[str, Any], who: str, replicas: Replicas) -> list[int]:
    """Every replica must run the same pipeline (stages, schedule, blocks), or their reductions mix layers.

    Returns the world ranks that run this rank's stages in the other replicas."""
    agreement.job.set(_LAYOUT_KEY + str(world_rank), json.dumps(layout, sort_keys=True))
    seen = [json.loads(raw) for raw in agreement.gather(_LAYOUT_KEY + "{}", range(world_size), "vpipe.attach",
                                                        who,
                                                        store=agreement.job)]
    differ = [r for r, other in enumerate(seen) if other != json.loads(json.dumps(layout))]
    if differ:
        raise ValueError(f"vpipe.attach on {who}: world rank(s) {differ} run another pipeline "
                         f"({seen[differ[0]]} vs {layout}); every data-parallel replica must run the same "
                         "stages, schedule and blocks")
    mine = replicas.world_ranks.index(world_rank)
    agreement.job.set(_FIRST_KEY + str(world_rank), json.dumps([replicas.world_ranks[0], mine]))
    where = [json.loads(raw) for raw in agreement.gather(_FIRST_KEY + "{}", range(world_size), "vpipe.attach",
                                                         who,
                                                         store=agreement.job)]
    return [r for r, (first, rank) in enumerate(where) if rank == mine and first != replicas.world_ranks[0]]


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


def slowest_and_fullest(records: Sequence[StageRecord]) -> StageRecord:
    """One stage's records from every replica as one: the slowest
    replica's, with the largest memory readings."""
    slowest = max(records, key=lambda r: (r.compute_s + r.outside_fwd_s + r.outside_bwd_s, r.step_s))
    return dataclasses.replace(slowest, **{name: max(getattr(r, name) for r in records)
                                           for name in _MEMORY_FIELDS})


class ReplicaStats:
    """A rank's sampled records shared with the same stages of the
    other replicas (see the module's docstring)."""

    def __init__(self, job: Any, *, world_rank: int, peers: Sequence[int], leads: bool,
                 timeout_s: float) -> None:
        self.job = job
        self.world_rank = world_rank
        self.peers = list(peers)  # the world ranks that run this rank's stages in the other replicas
        self.leads = leads
        self.timeout_s = timeout_s
        self._published: list[str] = []

    def __call__(self, iteration: int, records: list[StageRecord]) -> list[StageRecord]:
        """Followers publish ``records``; the leader returns them
        combined with every follower's, per stage."""
        if not records:
            return records
        if not self.leads:
            key = _STATS_KEY.format(iteration, self.world_rank)
            self.job.set(key, json.dumps([r.to_wire() for r in records]))
            self._published.append(key)
            self._forget()
            return records
        keys = [_STATS_KEY.format(iteration, peer) for peer in self.peers]
        deadline = time.monotonic() + self.timeout_s
        while not self.job.check(keys):  # a follower ends its step on its own: this wait cannot deadlock
            if time.monotonic() > deadline:
                log.warning("rank %d: the other replicas' records of step %d did not "
                            "arrive within %.0f s; the "
                            "planner sees this replica's only", self.world_rank, iteration, self.timeout_s)
                return records
            time.sleep(0.005)
        theirs = [[StageRecord.from_wire(w) for w in json.loads(raw)] for raw in self.job.multi_get(keys)]
        for key in keys:
            self.job.delete_key(key)
        by_stage = {r.stage: [r] for r in records}
        for replica in theirs:
            for r in replica:
                by_stage[r.stage].append(r)
        return [slowest_and_fullest(by_stage[r.stage]) for r in records]

    def _forget(self) -> None:
        """Keys the leader never read (it timed out) would pile up: keep the last few."""
        while len(self._published) > 16:
            key = self._published.pop(0)
            if self.job.check([key]):
                self.job.delete_key(key)
