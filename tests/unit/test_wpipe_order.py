"""ScheduleWPipe's order on a rank, without processes: G0's and G1's 1F1B lists,
their merge (the paper's Figure 5), and the micro-batches each virtual stage holds
as vpipe reads them off the lists the schedule writes."""

from __future__ import annotations

import pytest

from vpipe.schedules.wpipe import one_f_one_b, rank_orders, steady_order
from vpipe.sharing import in_flight_per_stage, in_flight_together


def test_a_stage_runs_its_1f1b_warmup_then_a_backward_and_a_forward_in_turn():
    assert one_f_one_b(2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert one_f_one_b(2, 1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    # the first step has no period before it (forwards alone); a flush no period after it (backwards alone)
    assert one_f_one_b(2, 0, 2, backwards=False) == [("F", 0), ("F", 1)]
    assert one_f_one_b(2, 0, 2, forwards=False) == [("B", 0), ("B", 1)]


def test_a_rank_takes_g0_and_g1_in_turn_once_both_can_run():
    assert rank_orders(2, 3)[0] == [(0, "F", 0), (0, "F", 1), (1, "F", 0), (0, "B", 0), (1, "F", 1),
                                    (0, "F", 2),
                                    (1, "B", 0), (0, "B", 1), (1, "F", 2), (1, "B", 1), (0, "B", 2),
                                    (1, "B", 2)]
    assert rank_orders(2, 3)[1] == [(0, "F", 0), (0, "B", 0), (1, "F", 0), (0, "F", 1), (1, "B", 0),
                                    (0, "B", 1),
                                    (1, "F", 1), (0, "F", 2), (1, "B", 1), (0, "B", 2), (1, "F", 2),
                                    (1, "B", 2)]
    assert rank_orders(2, 2, forwards=False)[0] == [(0, "B", 0), (0, "B", 1)]  # a flush: G0's backwards alone


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6])
def test_every_rank_runs_each_groups_1f1b_list_whole_and_in_its_order(ranks):
    for m in (ranks, ranks + 1, 2 * ranks + 1):
        for forwards, backwards in ((True, True), (True, False), (False, True)):
            for r, ops in rank_orders(ranks, m, forwards, backwards).items():
                g0 = [(k, j) for g, k, j in ops if g == 0]
                g1 = [(k, j) for g, k, j in ops if g == 1]
                assert g0 == one_f_one_b(ranks, r, m, forwards, backwards)
                assert g1 == (one_f_one_b(ranks, r, m) if forwards else [])


def test_g0_holds_its_period_and_the_next_ones_warmup_g1_its_1f1b_count():
    """On W ranks with m micro-batches G0's stage r holds m + W - r at its peak (the period before, in flight
    since the last step, and the warm-up of this one), G1's stage W + r holds W - r."""
    assert in_flight_per_stage(steady_order(2, 3), 4) == [5, 4, 2, 1]
    assert in_flight_per_stage(steady_order(4, 4), 8) == [8, 7, 6, 5, 4, 3, 2, 1]
    # interleaved, a rank's two stages peak together: rank 0's G0 stage holds 5 while its G1 stage holds 2
    assert in_flight_together(steady_order(2, 3), 4) == [[0, 4, 0, 1], [5, 0, 2, 0]]
