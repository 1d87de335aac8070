"""The pulse: every step's forward time of a rank's stage modules, and the changes it reports."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from vpipe.control.messages import decode, encode, make
from vpipe.monitors.pulse import StagePulse


class _Stage(nn.Module):
    """Two blocks whose forward waits ``wait_s``: a device whose speed the test sets."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.wait_s = 0.010

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.wait_s)
        return self.blocks(x)


def _steps(pulse: StagePulse, stage: _Stage, count: int, *, sampled: bool = False) -> list:
    changes = []
    for _ in range(count):
        pulse.begin_step(sampled)
        for _ in range(2):  # two micro-batches
            stage(torch.randn(2, 4)).sum().backward()
        changes.append(pulse.end_step())
    return changes


def test_a_stage_that_slows_down_and_recovers_is_reported_each_way_within_three_steps():
    stage = _Stage()
    pulse = StagePulse([stage], "cpu")
    assert not any(_steps(pulse, stage, 8))  # a steady stage says nothing
    stage.wait_s = 0.030  # three times as slow
    slowed = _steps(pulse, stage, 6)
    reported = [c for c in slowed if c is not None]
    # the first report comes within three steps (on a quiet machine it
    # is the only one: the level is learnt anew)
    assert reported and reported[0].ratio > 1.3 and slowed.index(reported[0]) <= 2
    assert "forward time per micro-batch changed" in reported[0].what
    stage.wait_s = 0.010
    recovered = _steps(pulse, stage, 6)
    back = [c for c in recovered if c is not None]
    assert back and back[0].ratio < 1 / 1.3 and recovered.index(back[0]) <= 2
    pulse.close()
    assert not stage._forward_hooks and not stage._forward_pre_hooks  # the hooks are gone


def test_sampled_steps_are_not_judged_and_freezing_is_a_change():
    stage = _Stage()
    pulse = StagePulse([stage], "cpu")
    _steps(pulse, stage, 6)
    stage.wait_s = 0.030
    assert not any(_steps(pulse, stage, 4, sampled=True))  # per-block hooks inflate sampled steps: not judged
    stage.wait_s = 0.010
    stage.blocks[0].requires_grad_(False)
    change = _steps(pulse, stage, 1)[0]
    assert change is not None and change.what == "trainable parameters changed from 4 to 2"


@pytest.mark.parametrize("body, problem", [
    ({"stage": -1, "what": "x", "ratio": 2.0}, "alert stage"),
    ({"stage": 0, "what": "x" * 201, "ratio": 2.0}, "alert what"),
    ({"stage": 0, "what": "x", "ratio": float("inf")}, "alert ratio"),
    ({"stage": 0, "what": "x"}, "ratio"),
])
def test_a_malformed_alert_is_refused_where_it_enters(body, problem):
    good = decode(encode(make("alert", {"stage": 1, "what": "slower", "ratio": 2.0}, stage=1)))
    assert good.body == {"stage": 1, "what": "slower", "ratio": 2.0}
    with pytest.raises(ValueError, match=problem):
        decode(encode(make("alert", body, stage=1)))


def test_steps_slowed_now_and_then_by_a_busy_core_are_not_a_change():
    """Ranks sharing cores see one step in a few 1.5-2x slower; a change is every step of the last three."""
    stage = _Stage()
    stage.wait_s = 0.040  # long enough that a busy machine's jitter stays well inside the threshold
    pulse = StagePulse([stage], "cpu")
    _steps(pulse, stage, 8)
    seen = []
    for wait in [0.080, 0.080, 0.040] * 4:  # two slow steps in every three: their median alone would be 2x
        stage.wait_s = wait
        seen += _steps(pulse, stage, 1)
    assert not any(seen)


def test_a_change_that_comes_as_the_sampling_interval_changes_is_still_reported():
    """The straggler benchmark's device recovered two steps before the interval doubled: learning the level
    anew there swallowed the change, and the planner learnt of it 49 steps later from its sparse samples."""
    stage = _Stage()
    pulse = StagePulse([stage], "cpu")
    _steps(pulse, stage, 8)
    stage.wait_s = 0.030
    changes = _steps(pulse, stage, 2)
    pulse.pause()  # the interval changed
    changes += _steps(pulse, stage, 4)
    reported = [c for c in changes if c is not None]
    assert reported and reported[0].ratio > 1.3 and changes.index(reported[0]) <= 4
