"""A round of moves waits no longer than the trainer's process-group
timeout, and a missed vote names who missed it."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from vpipe.compat.torch_distributed import group_timeout_s
from vpipe.migration.patience import FLOOR_S, RoundClock, VoteMarks, patience_s
from vpipe.migration.transfer import TransferChannel


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_every_wait_of_a_round_ends_by_the_groups_timeout_and_the_vote_gets_at_least_the_floor():
    # a late answer still finds the vote
    assert patience_s(30.0, 20.0) == 10.0 and patience_s(30.0, 1800.0) == 30.0
    now = Clock()
    clock = RoundClock(20.0, 10.0, now=now)
    assert clock.wait_s() == 10.0 and clock.wait_s(2) == 20.0 and clock.vote_s() == 20.0
    now.t += 15.0  # a handshake wait ran out, and more
    assert clock.wait_s() == 5.0 and clock.remaining_s() == 5.0 and clock.vote_s() == 5.0
    # past the round's end: waits take nothing more, the vote the floor (ranks start a round apart)
    now.t += 30.0
    assert clock.wait_s() == 0.0 and clock.vote_s() == FLOOR_S
    assert RoundClock(1.0, 0.5, now=now).vote_s() == 1.0  # a floor above a short timeout is the timeout


def test_a_missed_vote_names_the_ranks_that_never_reached_it():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5))
    job = dist.PrefixStore("job", store)
    marks = [VoteMarks(job, rank=r, world_size=4) for r in range(4)]
    for vote in (1, 2, 3):
        for r in (0, 2, 3):
            marks[r].arrive(vote)
    assert marks[0].absent(3) == [1] and marks[2].absent(3) == [1]
    assert marks[0].absent(4) == [0, 1, 2, 3]  # a vote nobody reached
    assert not job.check(["vote/1"]) and job.check(["vote/2"])  # rank 0 deletes all but the last two
    dead = VoteMarks(object(), rank=0, world_size=2)  # a store that cannot answer names nobody
    assert dead.absent(1) is None


def test_of_the_ranks_absent_from_a_vote_only_those_whose_beat_stood_still_are_named():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5))
    job = dist.PrefixStore("job", store)
    marks = [VoteMarks(job, rank=r, world_size=3) for r in range(3)]
    marks[1].start_beat(every_s=0.05)  # alive, still waiting for the payload of rank 2 (which stopped)
    try:
        assert marks[0].silent([1, 2], watch_s=0.5) == [2]
    finally:
        marks[1].close()
    assert marks[0].silent([1, 2], watch_s=0.3) == [1, 2]  # its beat stopped too
    assert VoteMarks(object(), rank=0, world_size=2).silent([1], watch_s=0.1) is None  # the store cannot say


@pytest.fixture
def one_rank_with_a_timeout():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=7))
    yield
    dist.destroy_process_group()


def test_the_transfer_group_takes_the_trainers_timeout_not_torchs_thirty_minutes(one_rank_with_a_timeout):
    assert group_timeout_s() == 7.0
    assert group_timeout_s(dist.new_group(backend="gloo")) == 1800.0  # what new_group() alone gets
    channel = TransferChannel(torch.device("cpu"))
    assert channel.timeout_s == 7.0 and group_timeout_s(channel.group) == 7.0
    assert channel.vote([(True, True), (False, False)], timeout_s=3.0) == [True, False]
    assert group_timeout_s(channel.group) == 7.0  # a shorter vote leaves the group's timeout as it was
