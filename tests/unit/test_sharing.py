"""A rank's stages share its room for saved activations by their peaks with every layer kept."""

from __future__ import annotations

import pytest

from vpipe.sharing import joint_peak, keep_all_shares


def test_without_the_schedules_moments_every_stage_peaks_at_once():
    assert joint_peak([10, 20], [3, 1]) == 50
    assert keep_all_shares(100, [10, 20], [3, 1]) == [60, 40]  # in proportion to the own peaks 30 and 20
    assert keep_all_shares(49, [10, 20], [3, 1]) is None  # keeping everything does not fit: the caller halves


def test_the_ranks_peak_is_its_largest_moment_and_each_share_covers_the_stages_own_peak():
    together = [[3, 0], [1, 1]]  # stage 0 holds 3 alone, or 1 while stage 1 holds 1
    assert joint_peak([10, 20], [3, 1], together) == 30
    shares = keep_all_shares(36, [10, 20], [3, 1], together)
    assert shares == [36, 24]  # 30 and 20 scaled by 36 / 30: more than the room together, never at once
    assert all(share >= count * kept for share, count, kept in zip(shares, [3, 1], [10, 20]))
    assert keep_all_shares(29, [10, 20], [3, 1], together) is None
    # moments over the whole pipeline (stages 0..3), the rank running stages 1 and 3: their columns count
    pipeline_wide = [[9, 3, 9, 0], [9, 1, 9, 1]]
    assert keep_all_shares(36, [10, 20], [3, 1], pipeline_wide, stages=[1, 3]) == shares


def test_a_stage_that_measured_nothing_yet_or_no_room_gives_no_shares():
    assert keep_all_shares(100, [10, 0], [1, 1]) is None
    assert keep_all_shares(0, [10, 20], [1, 1]) is None


def test_mismatched_lengths_are_refused_with_what_does_not_match():
    with pytest.raises(ValueError, match="2 stages' kept bytes, 1 in-flight counts"):
        keep_all_shares(100, [10, 20], [1])
    with pytest.raises(ValueError, match=r"moments of \[3\] stages"):
        keep_all_shares(100, [10, 20], [1, 1], [[1, 1, 1]])
