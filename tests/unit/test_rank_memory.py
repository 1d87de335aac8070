"""A rank's budget: fixed bytes first, then saved activations shared between its stages by what they need."""

from __future__ import annotations

from torch import nn

from vpipe.rank.memory import StageMemory

BUDGET = 1 << 20


def _rank(*indices: int, together=None) -> list[StageMemory]:
    siblings: list[StageMemory] = []
    for v in indices:  # 1088 bytes of weights, twice
        StageMemory(v, nn.Linear(16, 16), None, BUDGET, siblings=siblings, together=together)
    return siblings


def test_one_stage_gets_all_the_budget_its_weights_and_gradients_leave():
    (stage,) = _rank(0)
    assert stage.activation_budget(0, {0: (123, 1)}) == BUDGET - 2 * 1088


def test_a_ranks_stages_share_by_need_once_every_stage_measured_it_and_equally_before():
    first, second = _rank(0, 2)
    left = BUDGET - 4 * 1088
    assert first.activation_budget(0) == second.activation_budget(0) == left // 2
    # stage 2 has not measured it yet
    assert first.activation_budget(0, {0: (300, 1), 2: (0, 1)}) == left // 2
    needs = {0: (100, 3), 2: (100, 1)}  # without the schedule's moments: both peak at once, 300 + 100
    assert first.activation_budget(0, needs) == left * 3 // 4
    assert second.activation_budget(0, needs) == left // 4
    assert first.activation_budget(0, {0: (100, 1), 2: (300, 1)}) == left // 4  # needs changed: shared anew
    assert first.activation_budget(0, {0: (left, 1), 2: (1, 1)}) == left // 2  # keeping everything cannot fit


def test_stages_that_do_not_peak_together_each_get_at_least_their_own_peak():
    # the schedule's moments (columns: stages 0..3, this rank runs 0 and 2): stage 0 holds 4 micro-batches
    # while stage 2 holds none, stage 2 holds 2 once stage 0 is down to 1
    together = [[4, 0, 0, 0], [1, 0, 2, 0], [2, 0, 1, 0]]
    first, second = _rank(0, 2, together=together)
    left = BUDGET - 4 * 1088
    kept = left // 5
    # own peaks 4/5 and 2/5 of the room: 6/5 together, the rank's peak 4/5
    needs = {0: (kept, 4), 2: (kept, 2)}
    assert first.activation_budget(0, needs) == left
    assert second.activation_budget(0, needs) == left // 2
    first, second = _rank(0, 2)  # the same needs peaking together would not fit: halves
    assert first.activation_budget(0, needs) == second.activation_budget(0, needs) == left // 2
