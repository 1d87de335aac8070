"""ScheduleWPipe's order on a rank, without processes: G0's and G1's 1F1B lists, and the micro-batches each
virtual stage holds at once as vpipe reads them off the lists the schedule writes."""

from __future__ import annotations

from vpipe.schedules.wpipe import one_f_one_b, steady_order
from vpipe.sharing import in_flight_per_stage, in_flight_together


def test_a_stage_runs_its_1f1b_warmup_then_a_backward_and_a_forward_in_turn():
    assert one_f_one_b(2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert one_f_one_b(2, 1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    # the first step has no period before it (forwards alone); a flush no period after it (backwards alone)
    assert one_f_one_b(2, 0, 2, backwards=False) == [("F", 0), ("F", 1)]
    assert one_f_one_b(2, 0, 2, forwards=False) == [("B", 0), ("B", 1)]


def test_g0_holds_its_period_and_the_next_ones_warmup_g1_its_1f1b_count():
    """On W ranks with m micro-batches G0's stage r holds m + W - r at its peak (the period before, in flight
    since the last step, and the warm-up of this one), G1's stage W + r holds W - r."""
    assert in_flight_per_stage(steady_order(2, 3), 4) == [5, 4, 2, 1]
    assert in_flight_per_stage(steady_order(4, 4), 8) == [8, 7, 6, 5, 4, 3, 2, 1]
    # a rank's two stages never peak together: G0's peak comes while G1 holds nothing, G1's while G0 holds m
    assert in_flight_together(steady_order(2, 3), 4) == [[0, 3, 0, 1], [0, 4, 0, 0], [3, 0, 2, 0], [5, 0, 0, 0]]
