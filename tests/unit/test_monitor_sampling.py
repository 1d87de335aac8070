"""Which steps the monitors measure: the base rate, the back-off
while nothing changes, the restart after a change."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vpipe import VpipeConfig
from vpipe.control.session import ControlOptions, ControlSession
from vpipe.monitors.sampling import SampleSchedule
from vpipe.monitors.stage import StageMonitor
from vpipe.plan import Plan


def _sampled(schedule: SampleSchedule, steps: range) -> list[int]:
    return [i for i in steps if schedule.is_sampled(i)]


def test_a_fixed_schedule_samples_every_kth_step_and_never_the_first():
    assert _sampled(SampleSchedule(10), range(100)) == list(range(9, 100, 10))
    assert _sampled(SampleSchedule(1), range(5)) == [0, 1, 2, 3, 4]


def test_the_interval_doubles_after_each_run_of_samples_up_to_the_cap():
    schedule = SampleSchedule(10, max_every=40, backoff_after=3)
    assert _sampled(schedule, range(300)) == [9, 19, 29,  # 3 at the base rate
                                              49, 69, 89,  # 3 at 20
                                              129, 169, 209, 249, 289]  # capped at 40
    assert [schedule.interval_at(i) for i in (0, 29, 30, 89, 90, 10_000)] == [10, 10, 20, 20, 40, 40]


def test_a_restart_goes_back_to_the_base_rate_from_that_step():
    schedule = SampleSchedule(10, max_every=80, backoff_after=2)
    assert schedule.interval_at(1000) == 80
    schedule.restart(1003)
    assert _sampled(schedule, range(990, 1060)) == [1012, 1022, 1042]
    assert not schedule.is_sampled(1002)  # before the restart: nothing (the old phase is gone)


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, "sample_every must be a positive integer, got 0"),
    ({"every": 10, "max_every": 5}, r"max_sample_every \(5\) must be at least sample_every \(10\)"),
    ({"every": 10, "max_every": True}, "max_sample_every must be a positive integer, got True"),
    ({"every": 10, "backoff_after": 0}, "backoff_after must be a positive integer, got 0"),
])
def test_bad_schedules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SampleSchedule(**kwargs)


def test_the_config_caps_the_back_off_at_forty_base_intervals_unless_told():
    assert VpipeConfig().sample_every == 2 and VpipeConfig().sampling_cap == 80
    assert VpipeConfig(sample_every=3).sampling_cap == 120
    assert VpipeConfig(sample_every=10, max_sample_every=10).sampling_cap == 10  # never back off
    with pytest.raises(ValueError,
                       match=r"max_sample_every must be an integer >= sample_every \(10\) or None, "
                                         r"got 4"):
        VpipeConfig(sample_every=10, max_sample_every=4)


def test_a_monitor_records_exactly_the_scheduled_steps():
    torch.manual_seed(0)
    layers = {0: nn.Linear(4, 4), 1: nn.Linear(4, 4)}
    monitor = StageMonitor(layers, stage_index=0, device="cpu",
                           schedule=SampleSchedule(2, max_every=4, backoff_after=2))
    recorded = []
    for i in range(14):
        with monitor.iteration(i) as sample:
            layers[1](layers[0](torch.randn(2, 4))).sum().backward()
        if sample.record is not None:
            recorded.append(i)
            assert [layer.fwd_calls for layer in sample.record.layers] == [1, 1]
    assert recorded == [1, 3, 7, 11]
    monitor.close()


@pytest.fixture
def session():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, use_libuv=False)
    layers = {0: nn.Linear(4, 4), 1: nn.Linear(4, 4)}
    options = ControlOptions(sample_every=2, max_sample_every=8, planner=None)
    s = ControlSession({0: layers}, rank=0, stage_ranks=[0], store=store, world_size=1, device="cpu",
                       options=options)
    yield s
    s.close(timeout_s=0.1)


def test_a_new_plan_epoch_restarts_the_sessions_sampling_at_the_next_step(session):
    """Every rank commits the plan at the same step boundary, so every rank restarts at the same step."""
    def run(steps: range) -> list[int]:
        sampled = []
        for i in steps:
            session.begin_step(i)
            sampled += [i] if session.is_sampled(i) else []
            session.end_step()
        return sampled

    assert run(range(60)) == [1, 3, 5, 7, 9,  # 5 at the base rate (the default back-off)
                              13, 17, 21, 25, 29,  # 5 at every 4th
                              37, 45, 53]  # then every 8th, the cap
    # the epoch in force again: nothing changed
    session.plan_changed(Plan(epoch=0, stages=((0, 1),)), "applied")
    assert run(range(60, 68)) == [61]
    session.plan_changed(Plan(epoch=1, stages=((0, 1),)), "applied")  # a plan took effect before step 68
    assert run(range(68, 74)) == [69, 71, 73]
    assert session.plan == Plan(epoch=1, stages=((0, 1),)) and session.monitor.epoch == 1
