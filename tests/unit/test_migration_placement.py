"""Placement bookkeeping: layers per (virtual) stage, the rank of
each stage, and edits that keep it consistent."""

from __future__ import annotations

import pytest

from vpipe.migration.placement import Placement


def test_one_stage_per_rank_unless_told_otherwise():
    p = Placement.of([[0, 1], [2], [3, 4]])
    assert p.stages == ((0, 1), (2,), (3, 4)) and p.stage_ranks == (0, 1, 2)
    assert p.num_stages == 3 and p.order == [0, 1, 2, 3, 4]
    assert [p.rank_of(v) for v in range(3)] == [0, 1, 2]
    assert p.as_lists() == [[0, 1], [2], [3, 4]]


def test_virtual_stages_map_to_their_ranks():
    p = Placement.of([[0], [1], [2], [3]], [0, 1, 1, 0])  # a V: rank 0 runs the first and the last stage
    assert p.stages_of_rank(0) == [0, 3] and p.stages_of_rank(1) == [1, 2] and p.stages_of_rank(2) == []
    assert [p.stage_holding(lid) for lid in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="layer 9 is not placed"):
        p.stage_holding(9)


@pytest.mark.parametrize("stages, ranks, message", [
    ([[0], [1]], [0], "2 stages but 1 stage ranks"),
    ([[0, 1], [1]], None, "a layer is placed twice"),
])
def test_inconsistent_placements_are_refused(stages, ranks, message):
    with pytest.raises(ValueError, match=message):
        Placement.of(stages, ranks)


@pytest.mark.parametrize("position, stages, owner, at", [
    (0, ((7, 8, 0, 1), (2, 3)), 0, 0),  # before the first layer
    (1, ((0, 7, 8, 1), (2, 3)), 0, 1),
    (2, ((0, 1), (7, 8, 2, 3)), 1, 0),  # before a stage's first layer: that stage, at its front
    (4, ((0, 1), (2, 3, 7, 8)), 1, 2),  # after the last layer: the last stage
])
def test_added_layers_join_the_stage_holding_the_layer_at_their_position(position, stages, owner, at):
    p = Placement.of([[0, 1], [2, 3]], [0, 0])
    got, got_owner, got_at = p.with_added(position, [7, 8])
    assert (got.stages, got_owner, got_at) == (stages, owner, at)
    assert got.stage_ranks == (0, 0)  # ranks are kept
    assert p.stages == ((0, 1), (2, 3))  # frozen: the original is untouched


def test_adding_checks_the_position_and_the_new_ids():
    p = Placement.of([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"position 5 is outside 0\.\.4"):
        p.with_added(5, [9])
    with pytest.raises(ValueError, match=r"position -1 is outside 0\.\.4"):
        p.with_added(-1, [9])
    with pytest.raises(ValueError, match=r"new layer ids \[1, 3\] are already in use"):
        p.with_added(2, [3, 9, 1])


def test_removing_layers_keeps_every_stage_non_empty():
    p = Placement.of([[0, 1], [2, 3]], [1, 0])
    assert p.without([1, 2]) == Placement(((0,), (3,)), (1, 0))
    assert p.without([]) == p
    with pytest.raises(ValueError, match=r"removing \[0, 1\] would leave stage\(s\) \[0\] without layers"):
        p.without([0, 1])
    with pytest.raises(ValueError, match=r"cannot remove unknown layers \[5, 6\]"):
        p.without([6, 1, 5])


def test_with_stages_keeps_the_ranks_and_still_checks_for_duplicates():
    p = Placement.of([[0, 1], [2, 3]], [0, 0])
    assert p.with_stages([[0], [1, 2, 3]]) == Placement(((0,), (1, 2, 3)), (0, 0))
    with pytest.raises(ValueError, match="a layer is placed twice"):
        p.with_stages([[0, 1], [1, 2, 3]])
