"""A rank's budget: fixed bytes first, then saved activations shared between its stages by what they need."""

from __future__ import annotations

from torch import nn

from vpipe.rank.memory import StageMemory

BUDGET = 1 << 20


def _rank(*indices: int) -> list[StageMemory]:
    siblings: list[StageMemory] = []
    for v in indices:
        StageMemory(v, nn.Linear(16, 16), None, BUDGET, siblings=siblings)  # 1088 bytes of weights, twice
    return siblings


def test_one_stage_gets_all_the_budget_its_weights_and_gradients_leave():
    (stage,) = _rank(0)
    assert stage.activation_budget(0, {0: 123}) == BUDGET - 2 * 1088


def test_a_ranks_stages_share_by_need_once_every_stage_measured_it_and_equally_before():
    first, second = _rank(0, 2)
    left = BUDGET - 4 * 1088
    assert first.activation_budget(0) == second.activation_budget(0) == left // 2
    assert first.activation_budget(0, {0: 300, 2: 0}) == left // 2  # stage 2 has not measured its need yet
    needs = {0: 300, 2: 100}
    assert first.activation_budget(0, needs) == left * 3 // 4
    assert second.activation_budget(0, needs) == left // 4
    assert first.activation_budget(0, {0: 100, 2: 300}) == left // 4  # needs changed: shared anew
    assert first.activation_budget(0, {0: left, 2: 1}) == left // 2  # keeping everything cannot fit: halves
