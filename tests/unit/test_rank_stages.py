"""The stage adapter: how many micro-batches each stage of a
multi-stage schedule holds, and the optimizer check."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    _Action,
)

from vpipe.stage.pipeline import check_optimizer, in_flight_per_stage, in_flight_together


def _a(stage: int, kind, mb: int) -> _Action:
    return _Action(stage, kind, mb)


def test_a_stage_holds_a_micro_batch_from_its_forward_to_its_full_or_weight_backward():
    rank0 = [_a(0, FORWARD, 0), _a(0, FORWARD, 1), _a(2, FORWARD, 0), _a(2, FULL_BACKWARD, 0),
             _a(0, FORWARD, 2),
             _a(0, FULL_BACKWARD, 0), None, _a(2, FORWARD, 1), _a(2, FULL_BACKWARD, 1)]
    # zero bubble: the input-gradient pass keeps what the weight pass needs; the weight pass frees it
    rank1 = [_a(1, FORWARD, 0), _a(1, FORWARD, 1), _a(1, BACKWARD_INPUT, 0), _a(1, FORWARD, 2),
             _a(1, BACKWARD_WEIGHT, 0), _a(3, FORWARD, 0),
             _Action(3, OVERLAP_F_B, None, (_a(3, FORWARD, 1), _a(3, FULL_BACKWARD, 0)))]
    assert in_flight_per_stage({0: rank0, 1: rank1}, 4) == [3, 3, 1, 2]


def test_a_stage_that_never_runs_a_forward_counts_as_holding_one():
    assert in_flight_per_stage({0: [_a(0, FORWARD, 0), _a(0, FULL_BACKWARD, 0)]}, 2) == [1, 1]


def test_the_moments_of_a_rank_say_what_its_stages_hold_together_not_the_sum_of_their_peaks():
    rank0 = [_a(0, FORWARD, 0), _a(0, FORWARD, 1), _a(0, FORWARD, 2), _a(0, FULL_BACKWARD, 0),
             _a(0, FULL_BACKWARD, 1), _a(2, FORWARD, 0), _a(2, FORWARD, 1), _a(2, FULL_BACKWARD, 0)]
    rows = in_flight_together({0: rank0}, 3)
    assert rows == [[1, 0, 2], [3, 0, 0]]  # [1, 0, 1] and the rows below [3, 0, 0] are covered by these
    # each stage's own peak (1 for one that never runs)
    assert in_flight_per_stage({0: rank0}, 3) == [3, 1, 2]


def test_an_optimizer_over_parameters_outside_the_stages_is_warned_about_once(caplog):
    stage, elsewhere = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": stage.parameters()},
                                 {"params": elsewhere.parameters(), "lr": 0.1}])
    with caplog.at_level(logging.WARNING, logger="vpipe.attach"):
        check_optimizer(optimizer, [stage])
        check_optimizer(torch.optim.SGD(stage.parameters()), [stage])  # only the stage's: nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "vpipe.attach: optimizer param group(s) [1] hold 2 parameter(s) that are not in this rank's stage "
        "modules; moves carry only the stages' parameters and their optimizer state, so those stay in this "
        "rank's optimizer"]
