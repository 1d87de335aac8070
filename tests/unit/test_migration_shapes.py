"""Boundary shapes: what each layer takes and sends, and whether a
move changes what crosses a stage boundary."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vpipe.migration.shapes import BoundaryShapes, meta_of, unwire_meta, wire_meta

F32 = "torch.float32"


class Pair(nn.Module):
    """Returns two tensors and a plain value: arity and non-tensor outputs count."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        return x, x[:, :1].to(torch.float16), 3


def test_meta_drops_the_batch_dimension_and_keeps_arity_and_dtypes():
    assert meta_of(torch.zeros(5, 3, 8)) == (((3, 8), F32),)
    assert meta_of((torch.zeros(5, 8), torch.zeros(5, 2, dtype=torch.int64), None)) == (
        ((8,), F32), ((2,), "torch.int64"), ("?",))
    assert meta_of([torch.zeros(2)]) == (((), F32),)


def test_the_wire_form_round_trips_and_garbage_becomes_unknown():
    meta = meta_of((torch.zeros(5, 3, 8), "text"))
    wired = wire_meta(meta)
    assert wired == [[[3, 8], F32], ["?"]]
    assert unwire_meta(wired) == meta
    assert wire_meta(None) is None and unwire_meta(None) is None
    assert unwire_meta([[3]]) == (("?",),)  # an entry that is not (shape, dtype): a non-tensor
    for garbage in ("3x8", [[["a"], F32]], [5], [[None, F32]]):
        assert unwire_meta(garbage) is None, garbage


def test_the_first_call_of_a_watched_layer_is_recorded_and_unwatching_stops_it():
    shapes = BoundaryShapes()
    wide, pair = nn.Linear(4, 6), Pair()
    shapes.watch(0, wide)
    shapes.watch(1, pair)
    wide(torch.zeros(2, 4))
    wide(torch.zeros(2, 7, 4))  # a later call does not overwrite the first
    pair(torch.zeros(2, 4))
    assert shapes.out_meta == {0: (((6,), F32),), 1: (((4,), F32), ((1,), "torch.float16"), ("?",))}
    assert shapes.in_meta == {0: (((4,), F32),), 1: (((4,), F32),)}
    assert shapes.describe(0) == {"out_meta": [[[6], F32]], "in_meta": [[[4], F32]]}
    assert shapes.describe(5) == {"out_meta": None, "in_meta": None}  # never ran here
    shapes.unwatch(0)
    shapes.forget(1)
    assert not wide._forward_hooks and not pair._forward_hooks
    # unwatch keeps, forget drops
    assert 0 in shapes.out_meta and 1 not in shapes.out_meta and 1 not in shapes.in_meta
    other = nn.Linear(4, 4)
    shapes.watch(2, other)
    shapes.close()
    other(torch.zeros(1, 4))
    assert 2 not in shapes.out_meta and not other._forward_hooks
    shapes.unwatch(7)  # unknown ids are fine


def test_a_moved_layer_brings_its_shapes():
    here, there = BoundaryShapes(), BoundaryShapes()
    layer = nn.Linear(4, 6)
    here.watch(3, layer)
    layer(torch.zeros(2, 4))
    there.learn(3, here.describe(3))
    assert there.out_meta[3] == here.out_meta[3] and there.in_meta[3] == here.in_meta[3]
    there.learn(4, {"out_meta": "bad", "in_meta": None})  # unreadable metadata is not learned
    assert 4 not in there.out_meta and 4 not in there.in_meta


def _known(out: dict[int, tuple], inputs: dict[int, tuple] | None = None) -> BoundaryShapes:
    shapes = BoundaryShapes()
    shapes.out_meta.update(out)
    shapes.in_meta.update(inputs or {})
    return shapes


W4, W8 = (((4,), F32),), (((8,), F32),)


@pytest.mark.parametrize("before, after, out, arriving, changes", [
    ((0, 1, 2), (0, 1, 2, 3), {2: W4}, {}, True),  # the new last layer is unknown: counts as a change
    ((0, 1, 2), (0, 1, 2, 3), {2: W4, 3: W4}, {}, False),  # same output: nothing to redo
    # the last layer leaves, the one before sends another shape
    ((0, 1, 2), (0, 1), {1: W4, 2: W8}, {}, True),
    ((0, 1, 2), (0, 1, 2, 3), {2: W4}, {3: {"out_meta": [[[4], F32]]}}, False),  # arriving: its manifest says
    ((0, 1, 2), (0, 1, 2, 3), {2: W4}, {3: {"out_meta": [[[8], F32]]}}, True),
    ((0, 1, 2), (1, 2), {}, {}, False),  # the last layer stays: the stage sends the same
    ((), (0,), {}, {}, False),
])
def test_last_output_changes(before, after, out, arriving, changes):
    assert _known(out).last_output_changes(before, after, arriving) is changes


def test_boundary_changes_are_judged_by_the_stage_that_held_the_new_last_layer():
    before = ((0, 1, 2), (3, 4), (5,))
    # stage 0 gives layer 2 away: boundary 0 now carries layer 1's
    # output instead of layer 2's; stage 0 ran both
    after = ((0, 1), (2, 3, 4), (5,))
    assert _known({1: W4, 2: W4}).boundary_changed(0, before, after) is False
    assert _known({1: W8, 2: W4}).boundary_changed(0, before, after) is True
    assert _known({2: W4}).boundary_changed(0, before, after) is True  # layer 1 never ran: unknown
    assert _known({}).boundary_changed(1, before, after) is False  # stage 1 never held layer 1: not its call
    # stage 1 gives layer 4 to stage 2: boundary 1 carries layer 3's output instead of layer 4's
    after = ((0, 1, 2), (3,), (4, 5))
    assert _known({3: W4, 4: W4}).boundary_changed(1, before, after) is False
    assert _known({3: W8, 4: W4}).boundary_changed(1, before, after) is True
    assert _known({3: W8, 4: W4}).boundary_changed(2, before, after) is False  # judged by stage 1
    # stage 1 gives layer 3 back to stage 0: boundary 0 carries layer 3's output; stage 1 knows what the
    # boundary carried before as the input of its old first layer
    after = ((0, 1, 2, 3), (4,), (5,))
    assert _known({3: W4}, {3: W4}).boundary_changed(1, before, after) is False
    assert _known({3: W8}, {3: W4}).boundary_changed(1, before, after) is True
    assert _known({3: W8}, {3: W4}).boundary_changed(0, before, after) is False  # judged by stage 1
    assert _known({}).boundary_changed(1, before, before) is False  # nothing moves
