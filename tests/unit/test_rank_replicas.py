"""Data-parallel replicas of a pipeline apply the leading replica's
plans at the same step (in-process, one store)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from support.monitors import stage_record
from vpipe.plan import Plan
from vpipe.rank.agreement import StoreAgreement
from vpipe.rank.boundary import PlanBoundary
from vpipe.rank.replicas import ReplicaPlans, Replicas, ReplicaStats

PLAN = Plan(epoch=1, stages=((0, 1, 2), (3, 4, 5)))


def _boundaries(store: dist.Store) -> tuple[PlanBoundary, PlanBoundary]:
    """Stage 0 of the leading replica and stage 0 of a follower, in one attach's namespaces."""
    leader = StoreAgreement(store, rank=0, world_size=2, timeout_s=1.0, pipeline="pipeline-0/")
    follower = StoreAgreement(store, rank=0, world_size=2, timeout_s=1.0, pipeline="pipeline-2/")
    follower.job = leader.job  # the same attach (the counter numbers attaches per process)
    return (PlanBoundary(leader, decides=True, lag_steps=2, streamed=False, who="stage 0",
                         replicas=ReplicaPlans(leader.job)),
            PlanBoundary(follower, decides=True, lag_steps=2, streamed=False, who="stage 0",
                         replicas=ReplicaPlans(follower.job), follows=True))


def test_a_follower_applies_the_leaders_plan_at_the_leaders_step_and_never_its_own():
    leader, follower = _boundaries(dist.HashStore())
    follower.received([Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5)))], iteration=3, current_epoch=0)  # ignored
    leader.received([PLAN], iteration=4, current_epoch=0)  # scheduled for step 6
    assert leader.due(5) == [] and follower.due(5) == []
    assert leader.due(6) == [PLAN]
    assert follower.due(6) == [PLAN]


def test_a_follower_that_sees_a_plan_after_its_step_fails_instead_of_diverging():
    leader, follower = _boundaries(dist.HashStore())
    leader.received([PLAN], iteration=4, current_epoch=0)
    with pytest.raises(RuntimeError,
                       match="plan epoch 1 was due at step 6 but this stage only saw the decision at step 7"):
        follower.due(7)


def test_replicas_name_their_namespace_and_leader():
    assert Replicas((0, 1, 2, 3), 4).name == "" and Replicas((0, 1, 2, 3), 4).leads
    second = Replicas((1, 3), 4)  # a (pp, dp) mesh: stage 0 of the second replica is world rank 1
    assert second.count == 2 and not second.leads and second.name == "pipeline-1/"


def test_the_planner_sees_per_stage_the_slowest_replicas_times_and_the_fullest_memory():
    fast = stage_record(stage=1, iteration=9, device_peak_bytes=50 << 20)
    slow = stage_record(stage=1, iteration=9, layers=(3, 4), step_s=0.3, device_peak_bytes=20 << 20)
    slow = dataclasses.replace(slow, layers=tuple(dataclasses.replace(x, fwd_s=x.fwd_s * 3)
                                                  for x in slow.layers))
    store = dist.HashStore()
    follower = ReplicaStats(store, world_rank=3, peers=[1], leads=False, timeout_s=1.0)
    leader = ReplicaStats(store, world_rank=1, peers=[3], leads=True, timeout_s=1.0)
    assert follower(9, [slow]) == [slow]  # a follower's own chain goes on with its own records
    (combined,) = leader(9, [fast])
    assert combined.layers == slow.layers and combined.step_s == 0.3  # the slowest replica's times
    assert combined.device_peak_bytes == 50 << 20  # the fullest replica's memory
    assert not store.check(["stats/9/3"])  # read once, then gone


def test_a_leader_whose_followers_never_report_goes_on_with_its_own_records():
    record = stage_record(stage=0)
    leader = ReplicaStats(dist.HashStore(), world_rank=0, peers=[2], leads=True, timeout_s=0.05)
    assert leader(9, [record]) == [record]
    assert leader(10, []) == []  # an unsampled step waits for nobody


def test_one_ranks_reason_layers_cannot_move_turns_moves_off_on_every_rank_of_the_job():
    """A round of moves ends in a vote of every rank: either all ranks move layers or none does."""
    store = dist.HashStore()
    ranks = [StoreAgreement(store, rank=0, world_size=2, timeout_s=1.0, pipeline=f"pipeline-{r}/")
             for r in range(3)]
    for agreement in ranks[1:]:
        agreement.job = ranks[0].job  # one attach: the counter numbers attaches per process
    ranks[2].job.set("refusal/2", "null")  # world rank 2 has no reason (written before the others wait)
    ranks[1].job.set("refusal/1", '"FSDP: a block is not fully_shard-ed by itself"')
    assert ranks[0].agree_refusal(None, world_rank=0, world_size=3, who="stage 0") == (
        "FSDP: a block is not fully_shard-ed by itself")
    with pytest.raises(RuntimeError, match=r"stage\(s\) \[3\] did not make the same call"):
        ranks[0].agree_refusal(None, world_rank=0, world_size=4, who="stage 0")
