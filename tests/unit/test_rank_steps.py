"""The step driver around a schedule's ``step``: what each stage's tensor manager hears when a step ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vpipe.rank.parts import RankParts
from vpipe.rank.steps import StepDriver


class _Manager:
    def __init__(self) -> None:
        self.metering = True
        self.steps_ended = 0

    def end_of_step(self) -> None:
        self.steps_ended += 1


def _driver(kind: str, managers: dict[int, _Manager]) -> StepDriver:
    session = SimpleNamespace(begin_step=lambda it: None, is_sampled=lambda it: False, end_step=lambda: [],
                              abort_step=lambda: None)
    boundary = SimpleNamespace(applying_step=lambda it: it, due=lambda it: [], received=lambda *a: None)
    applier = SimpleNamespace(continue_streamed=lambda *a: None)
    memories = {v: SimpleNamespace(budget=None) for v in managers}
    parts = RankParts(pipeline=SimpleNamespace(kind=kind), layer_manager=None, session=session,
                      tensor_managers=managers, memories=memories, plan_in_force=SimpleNamespace(epoch=0),
                      engine=SimpleNamespace(streams=kind == "pipedream", stream=None))
    return StepDriver(parts, boundary=boundary, applier=applier, micro_batches=4, logs_steps=False)


def test_a_flush_schedules_step_clears_what_its_managers_count_in_flight():
    """After a flush schedule's step every backward has run: a move
    at the next boundary finds no layer busy."""
    managers = {0: _Manager(), 3: _Manager()}
    driver = _driver("1f1b", managers)
    assert driver.run(lambda: "loss") == "loss"
    assert [m.steps_ended for m in managers.values()] == [1, 1] and driver.iteration == 1


def test_a_pipedream_step_leaves_its_micro_batches_in_flight():
    managers = {0: _Manager()}
    driver = _driver("pipedream", managers)
    driver.run(lambda: None)
    assert managers[0].steps_ended == 0  # its micro-batches run on across steps


def test_a_failed_step_is_not_ended():
    managers = {0: _Manager()}
    driver = _driver("1f1b", managers)

    def failing() -> None:
        raise ValueError("a failing step")

    with pytest.raises(ValueError, match="a failing step"):
        driver.run(failing)
    assert managers[0].steps_ended == 0 and driver.iteration == 0
