"""The layer manager with fake peers: moves commit on both sides or on neither, local moves re-parent, edits.

Every rank of a "run" is a :class:`LayerManager` on its own thread of this process; they
talk through the fakes of :mod:`migration_support` (the real message codec, queues for
payloads, a barrier for votes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from support.migration import (
    TWO,
    WAIT_S,
    WIDTH,
    Block,
    FakeChannel,
    FakeMessenger,
    Hub,
    Rank,
    assert_unchanged,
    on_every_rank,
    placement_snapshot,
    run_ranks,
)
from vpipe.migration.handshake import MigrationError
from vpipe.migration.layer_manager import LayerManager
from vpipe.migration.moves import Move
from vpipe.migration.state import pack_layer
from vpipe.plan import Plan


class Other(Block):
    """Another kind of block: a rank holding only these cannot build a Block without a factory."""






def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
             for p in module.parameters()]
    return params, state


def assert_state_equal(module: nn.Module, optimizer: torch.optim.Optimizer,
                       want: tuple[dict, list[dict]]) -> None:
    params, state = want
    got = dict(module.named_parameters())
    assert sorted(got) == sorted(params)
    for name, value in params.items():
        assert torch.equal(got[name].detach(), value), name
    for p, expected in zip(module.parameters(), state):
        assert sorted(optimizer.state[p]) == sorted(expected)
        for key, value in expected.items():
            if torch.is_tensor(value):
                assert torch.equal(optimizer.state[p][key], value), key
            else:
                assert optimizer.state[p][key] == value, key




# ---------------------------------------------------------------------- moves between ranks
def test_a_move_to_the_next_stage_commits_on_both_ranks():
    hub = Hub(2)
    src, dst = Rank(0, TWO, [0, 1], hub), Rank(1, TWO, [0, 1], hub)
    moving = src.block(2)
    before = snapshot(moving, src.optimizer)
    expected_bytes = pack_layer(2, moving, src.optimizer).nbytes
    moving_ids = {id(p) for p in moving.parameters()}
    containers = (src.containers[0], dst.containers[1])

    reports = run_ranks([src, dst], Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5))))

    for r in reports:
        assert r.epoch == 1 and r.moved == [Move(0, 1, (2,))] and r.aborted == []
        assert not r.rebuilt  # Linear(4, 4) blocks: stage 0 still sends a (.., 4) float32
    assert reports[0].bytes_sent == reports[1].bytes_received == expected_bytes > 0
    assert reports[0].bytes_received == reports[1].bytes_sent == 0
    for rank in (src, dst):
        assert rank.placement == ((0, 1), (2, 3, 4, 5))
    # the containers are the user's objects, edited in place
    assert (
        src.manager.blocks[0].container is containers[0] and dst.manager.blocks[1].container is containers[1]
    )
    assert src.keys() == {0: ["0", "1"]} and dst.keys() == {1: ["2", "3", "4", "5"]}
    assert src.manager.layer_ids == [0, 1] and dst.manager.layer_ids == [2, 3, 4, 5]
    # the source forgot the layer and its optimizer state
    assert not moving_ids & set(src.optimizer_params())
    assert not any(id(p) in moving_ids for p in src.optimizer.state)
    # the target holds a new block (a clone of one of its own) with the moved weights, attributes and state
    arrived = dst.block(2)
    assert arrived is not moving and type(arrived) is Block and arrived.index == 2
    assert_state_equal(arrived, dst.optimizer, before)
    assert {id(p) for p in arrived.parameters()} <= set(dst.optimizer_params())
    assert dst.manager.shapes.out_meta[2] == (((WIDTH,), "torch.float32"),)  # its shapes came with it
    # the listeners followed
    assert src.listeners[0].events == [("remove", 2, None)]
    assert dst.listeners[1].events == [("add", 2, arrived)]
    # the handshake, in order, one vote per round
    assert [(m[0], m[1], m[2]) for m in hub.log] == [
        (0, 1, "migrate_prepare"), (1, 0, "migrate_ready"), (0, 1, "migrate_transfer"), (1, 0, "migrate_ack")]
    assert hub.votes == 1
    dst.train_step()  # the moved layer trains on its new rank
    assert dst.optimizer.state[arrived.fc.weight]["step"].item() == before[1][0]["step"].item() + 1


def test_a_move_upstream_appends_to_the_previous_stage():
    hub = Hub(2)
    left, right = Rank(0, TWO, [0, 1], hub), Rank(1, TWO, [0, 1], hub)
    moving = [right.block(3), right.block(4)]
    before = [snapshot(b, right.optimizer) for b in moving]
    reports = run_ranks([left, right], Plan(epoch=4, stages=((0, 1, 2, 3, 4), (5,))))
    assert all(r.moved == [Move(1, 0, (3, 4))] for r in reports)
    assert left.keys() == {0: ["0", "1", "2", "3", "4"]} and right.keys() == {1: ["5"]}
    for lid, want in zip((3, 4), before):
        assert left.block(lid).index == lid
        assert_state_equal(left.block(lid), left.optimizer, want)
    assert [e[:2] for e in left.listeners[0].events] == [("add", 3), ("add", 4)]
    assert right.listeners[1].events == [("remove", 3, None), ("remove", 4, None)]
    assert right.optimizer_params() == [id(p) for p in right.block(5).parameters()]


def test_a_move_by_the_layer_factory_carries_the_spec_and_a_changed_boundary_is_reported_on_every_rank():
    """Stage 0 ends with a wider layer; moving it makes stage 0 send
    another shape: both ranks must re-infer."""
    specs = {0: 4, 1: 4, 2: 8, 3: 8}

    def factory(layer_id: int, width: int) -> nn.Module:
        return nn.Sequential(nn.Linear(4, width)) if layer_id < 3 else nn.Sequential(nn.Linear(8, 8))

    hub = Hub(2)
    placement = [[0, 1, 2], [3]]
    ranks = []
    for rank in (0, 1):
        torch.manual_seed(rank)
        blocks = nn.Sequential(OrderedDict((str(lid), factory(lid, specs[lid])) for lid in placement[rank]))
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1, momentum=0.9)
        manager = LayerManager({rank: blocks}, placement=placement, optimizer=opt, factory=factory,
                               # its own layers' specs only
                               specs={lid: specs[lid] for lid in placement[rank]},
                               messenger=FakeMessenger(hub, rank), channel=FakeChannel(hub, rank),
                               device=torch.device("cpu"), timeout_s=WAIT_S)
        blocks(torch.randn(2, 4 if rank == 0 else 8)).sum().backward()  # (.., 4) -> 4 -> 4 -> 8 | 8 -> 8
        opt.step()
        ranks.append((blocks, opt, manager))
    moving = ranks[0][0]._modules["2"]
    want = snapshot(moving, ranks[0][1])

    reports = run_ranks([m for _, _, m in ranks], Plan(epoch=1, stages=((0, 1), (2, 3))), start=placement)
    # stage 0 now ends with a (.., 4) layer; the last stage's own output did not change: the vote is "any"
    assert [r.rebuilt for r in reports] == [True, True]
    blocks1, opt1, manager1 = ranks[1]
    arrived = blocks1._modules["2"]
    assert list(blocks1._modules) == ["2", "3"] and arrived[0].out_features == 8
    assert_state_equal(arrived, opt1, want)  # SGD momentum buffers moved too
    assert manager1.specs[2] == 8  # the spec travelled with the layer


def test_two_moves_between_the_same_ranks_in_one_round_keep_their_messages_and_payloads_apart():
    """Stages 0 and 2 on rank 0, 1 and 3 on rank 1 (an interleaved layout): two moves rank 0 -> 1 at once."""
    placement = [[0, 1, 2], [3], [4, 5, 6], [7]]
    ranks_of = [0, 1, 0, 1]
    hub = Hub(2)
    a, b = Rank(0, placement, ranks_of, hub), Rank(1, placement, ranks_of, hub)
    before = {lid: snapshot(a.block(lid), a.optimizer) for lid in (2, 6)}
    reports = run_ranks([a, b], Plan(epoch=1, stages=((0, 1), (2, 3), (4, 5), (6, 7))))
    assert all(r.moved == [Move(0, 1, (2,)), Move(2, 3, (6,))] for r in reports)
    assert a.keys() == {0: ["0", "1"], 2: ["4", "5"]} and b.keys() == {1: ["2", "3"], 3: ["6", "7"]}
    for lid, want in before.items():
        assert b.block(lid).index == lid
        assert_state_equal(b.block(lid), b.optimizer, want)
    assert sorted(m[3]["move"] for m in hub.messages("migrate_prepare")) == [1, 5]  # 2 * src + forward
    assert [e[:2] for e in b.listeners[1].events] == [("add", 2)]
    assert [e[:2] for e in b.listeners[3].events] == [("add", 6)]


def test_a_layer_two_stages_away_hops_twice_and_keeps_its_state():
    placement = [[0, 1, 2], [3], [4]]
    hub = Hub(3)
    ranks = [Rank(r, placement, [0, 1, 2], hub) for r in range(3)]
    want = snapshot(ranks[0].block(2), ranks[0].optimizer)
    reports = run_ranks(ranks, Plan(epoch=1, stages=((0,), (1,), (2, 3, 4))))
    assert reports[0].moved == [Move(0, 1, (1, 2))]
    assert reports[1].moved == [Move(0, 1, (1, 2)), Move(1, 2, (3,)), Move(1, 2, (2,))]
    assert reports[2].moved == [Move(1, 2, (3,)), Move(1, 2, (2,))]
    assert [r.keys() for r in ranks] == [{0: ["0"]}, {1: ["1"]}, {2: ["2", "3", "4"]}]
    assert_state_equal(ranks[2].block(2), ranks[2].optimizer, want)
    assert hub.votes == 2
    assert [e[:2] for e in ranks[1].listeners[1].events] == [("remove", 3), ("add", 1), ("add", 2),
                                                             ("remove", 2)]






def test_a_target_that_cannot_build_the_layers_answers_abort_and_nothing_moves(caplog):
    hub = Hub(2)
    # no Block on rank 1, no factory
    ranks = [Rank(0, TWO, [0, 1], hub), Rank(1, TWO, [0, 1], hub, kind=Other)]
    keys, params, states = placement_snapshot(ranks)
    with caplog.at_level(logging.INFO, logger="vpipe"):
        reports = run_ranks(ranks, Plan(epoch=2, stages=((0, 1), (2, 3, 4, 5))))
    for r in reports:
        assert r.moved == [] and r.aborted == [Move(0, 1, (2,))] and r.bytes_sent == r.bytes_received == 0
    assert [rank.placement for rank in ranks] == [tuple(map(tuple, TWO))] * 2
    assert_unchanged(ranks, keys, params, states)
    assert [(m[0], m[1], m[2]) for m in hub.log] == [(0, 1, "migrate_prepare"), (1, 0, "migrate_abort")]
    assert hub.log[1][3]["reason"].startswith("this rank has no block of kind Block#")
    events = [getattr(rec, "vpipe_fields", {}).get("event") for rec in caplog.records]
    assert events.count("migration_refused") == 1 and events.count("migration_aborted") == 2


def test_a_silent_target_is_given_up_on_and_both_placements_stay():
    points: list[str] = []
    hub = Hub(2)
    ranks = [Rank(0, TWO, [0, 1], hub, timeout_s=0.5),
             Rank(1, TWO, [0, 1], hub, faults=lambda point: points.append(point) or True)]
    keys, params, states = placement_snapshot(ranks)
    reports = run_ranks(ranks, Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5))))
    assert points == ["prepare_received"]
    for r in reports:
        assert r.moved == [] and r.aborted == [Move(0, 1, (2,))]
    assert_unchanged(ranks, keys, params, states)
    # the source waited for a ready that never came, and told the target to forget the move
    assert [(m[0], m[1], m[2], m[3].get("reason")) for m in hub.log] == [
        (0, 1, "migrate_prepare", None), (0, 1, "migrate_abort", "no ready")]
    assert not hub.wire  # no payload was sent


def test_an_aborted_round_stops_the_plan_there_on_every_rank():
    placement = [[0, 1, 2], [3], [4]]
    hub = Hub(3)
    ranks = [Rank(0, placement, [0, 1, 2], hub, timeout_s=0.5),
             Rank(1, placement, [0, 1, 2], hub, faults=lambda point: True),  # silent towards stage 0
             Rank(2, placement, [0, 1, 2], hub)]
    keys, params, states = placement_snapshot(ranks)
    reports = run_ranks(ranks, Plan(epoch=1, stages=((0,), (1,), (2, 3, 4))))
    assert reports[1].aborted == [Move(0, 1, (1, 2)), Move(1, 2, (3,))]  # the good move of the round too
    assert reports[2].aborted == [Move(1, 2, (3,))] and all(r.moved == [] for r in reports)
    assert_unchanged(ranks, keys, params, states)
    assert hub.votes == 1 and {m[3]["round"] for m in hub.log} == {0}  # round 1 never started
    assert all(r.placement == tuple(map(tuple, placement)) for r in ranks)


def test_announced_layers_that_differ_from_the_plan_stop_the_target():
    """A peer whose plan differs (a bug elsewhere) must not make this rank take layers it was not told of."""
    hub = Hub(2)
    target = Rank(1, TWO, [0, 1], hub)
    manifest = pack_layer(1, Block(1), None).manifest
    FakeMessenger(hub, 0).send_to(1, "migrate_prepare",
                                  {"round": 0, "move": 1, "src": 0, "dst": 1, "layers": [1],
                                                         "manifests": [manifest]}, epoch=1)
    with pytest.raises(MigrationError,
                       match=r"stage 1: stage 0 announced layers \[1\] but the plan moves \[2\]"):
        target.apply(Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5))))
    assert target.keys() == {1: ["3", "4", "5"]}


# ---------------------------------------------------------------------- stages of one rank
def _one_rank(placement: Sequence[Sequence[int]], stage_ranks: Sequence[int], **kwargs: Any) -> Rank:
    rank = Rank(0, placement, stage_ranks, Hub(1), **kwargs)
    rank.manager.messenger = _NoMessages()  # type: ignore[assignment]
    return rank


class _NoMessages:
    def send_to(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a local move sent a message: {args}")

    def wait_for(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a local move waited for a message: {args}")


@pytest.mark.parametrize("target, moved, keys", [
    (((0, 1), (2, 3, 4)), [Move(0, 1, (2,))], {0: ["0", "1"], 1: ["2", "3", "4"]}),
    (((0, 1, 2, 3), (4,)), [Move(1, 0, (3,))], {0: ["0", "1", "2", "3"], 1: ["4"]}),
])
def test_a_move_between_two_stages_of_one_rank_re_parents_the_blocks_without_a_message(target, moved, keys):
    rank = _one_rank([[0, 1, 2], [3, 4]], [0, 0])
    blocks = {lid: rank.block(lid) for lid in range(5)}
    params, states = rank.optimizer_params(), {id(p): dict(s) for p, s in rank.optimizer.state.items()}
    report = rank.apply(Plan(epoch=1, stages=target))
    assert report.moved == moved and report.aborted == [] and report.bytes_sent == report.bytes_received == 0
    assert rank.keys() == keys and rank.placement == target
    assert all(rank.block(lid) is blocks[lid] for lid in range(5))  # the same modules, in another container
    assert rank.optimizer_params() == params  # one optimizer for both stages: nothing to move
    assert {id(p): dict(s) for p, s in rank.optimizer.state.items()} == states
    (m,) = moved
    for lid in m.layers:
        assert ("remove", lid, None) in rank.listeners[m.src].events
        assert ("add", lid, blocks[lid]) in rank.listeners[m.dst].events
    assert rank.manager.layers_of(m.dst) == [int(k) for k in keys[m.dst]]


def test_a_v_shaped_layout_moves_locally_at_the_turn_and_across_ranks_elsewhere():
    """Stages 0 and 3 on rank 0, 1 and 2 on rank 1: one round moves
    0 -> 1 across ranks and 1 -> 2 inside rank 1."""
    placement = [[0, 1], [2, 3], [4, 5], [6, 7]]
    ranks_of = [0, 1, 1, 0]
    hub = Hub(2)
    a, b = Rank(0, placement, ranks_of, hub), Rank(1, placement, ranks_of, hub)
    turning = b.block(3)
    reports = run_ranks([a, b], Plan(epoch=1, stages=((0,), (1, 2), (3, 4, 5), (6, 7))))
    assert reports[0].moved == [Move(0, 1, (1,))]
    assert reports[1].moved == [Move(0, 1, (1,)), Move(1, 2, (3,))]
    assert a.keys() == {0: ["0"], 3: ["6", "7"]} and b.keys() == {1: ["1", "2"], 2: ["3", "4", "5"]}
    assert b.block(3) is turning  # re-parented, not copied
    assert [m[2] for m in hub.log] == ["migrate_prepare", "migrate_ready", "migrate_transfer", "migrate_ack"]


@pytest.mark.parametrize("kwargs, message", [
    ({"placement": [[0, 1], [2, 3]]}, r"stage 0 holds layers \[0, 1, 2\] but the placement says \[0, 1\]"),
    ({"stage_ranks": [0, 1]}, r"the local stages \[0, 1\] run on ranks \[0, 1\], not on one"),
])
def test_a_manager_whose_blocks_disagree_with_its_placement_is_refused(kwargs, message):
    containers = {0: nn.Sequential(OrderedDict((str(i), Block(i)) for i in (0, 1, 2))),
                  1: nn.Sequential(OrderedDict((str(i), Block(i)) for i in (3,)))}
    args = dict(placement=[[0, 1, 2], [3]], optimizer=None, factory=None, specs=None, messenger=_NoMessages(),
                channel=None, device=torch.device("cpu"), stage_ranks=[0, 0])
    with pytest.raises(ValueError, match=message):
        LayerManager(containers, **{**args, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a single block container needs stage_index="):
        LayerManager(containers[0], **args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- adding and removing layers
def _editing_pair(factory: Callable[[int, Any], nn.Module] | None = None) -> list[Rank]:
    hub = Hub(2)
    return [Rank(r, TWO, [0, 1], hub, factory=factory) for r in (0, 1)]


def test_added_layers_join_the_stage_at_their_position_and_its_optimizer():
    ranks = _editing_pair(factory=lambda lid, spec: Block(lid, width=spec))
    before = [r.optimizer_params() for r in ranks]
    assert [r.add_layers(3, [WIDTH, WIDTH]) for r in ranks] == [[6, 7], [6, 7]]
    for r in ranks:
        assert r.placement == ((0, 1, 2), (6, 7, 3, 4, 5))
        assert r.manager.specs[6] == r.manager.specs[7] == WIDTH
    owner, other = ranks[1], ranks[0]
    assert owner.keys() == {1: ["6", "7", "3", "4", "5"]} and other.keys() == {0: ["0", "1", "2"]}
    new = [owner.block(6), owner.block(7)]
    assert [b.index for b in new] == [6, 7]
    assert owner.optimizer_params() == before[1] + [id(p) for b in new for p in b.parameters()]
    assert other.optimizer_params() == before[0] and not other.listeners[0].events
    assert owner.listeners[1].events == [("add", 6, new[0]), ("add", 7, new[1])]
    # appended after the last layer: the last stage
    assert [r.add_layers(8, [WIDTH]) for r in ranks] == [[8], [8]]
    assert owner.keys()[1][-1] == "8" and ranks[0].placement[1][-1] == 8
    assert [r.add_layers(0, []) for r in ranks] == [[], []]


def test_adding_layers_checks_the_position_and_needs_a_factory_where_they_land():
    ranks = _editing_pair()
    with pytest.raises(ValueError, match=r"position 7 is outside 0\.\.6"):
        ranks[0].add_layers(7, [WIDTH])
    assert ranks[0].add_layers(4, [WIDTH]) == [6]  # lands on rank 1's stage: rank 0 builds nothing
    with pytest.raises(ValueError,
                       match="adding layers needs layer_factory= in the vpipe config to build them"):
        ranks[1].add_layers(4, [WIDTH])
    assert ranks[1].keys() == {1: ["3", "4", "5"]} and ranks[1].placement == tuple(map(tuple, TWO))


def test_removed_layers_leave_their_container_and_optimizer_and_ids_are_never_reused():
    ranks = _editing_pair(factory=lambda lid, spec: Block(lid, width=spec))
    doomed = ranks[1].block(5)
    doomed_ids = {id(p) for p in doomed.parameters()}
    assert any(id(p) in doomed_ids for p in ranks[1].optimizer.state)
    assert on_every_rank(ranks, lambda manager: manager.remove_layers(TWO, [1, 5])) == [  # the same shapes
        (False, ((0, 2), (3, 4)))] * 2
    for r in ranks:
        r.placement = ((0, 2), (3, 4))
    assert ranks[0].keys() == {0: ["0", "2"]} and ranks[1].keys() == {1: ["3", "4"]}
    assert all(r.placement == ((0, 2), (3, 4)) for r in ranks)
    assert not doomed_ids & set(ranks[1].optimizer_params())
    assert not any(id(p) in doomed_ids for p in ranks[1].optimizer.state)
    assert ranks[0].listeners[0].events == [("remove", 1, None)]
    assert ranks[1].listeners[1].events == [("remove", 5, None)]
    assert [r.add_layers(4, [WIDTH]) for r in ranks] == [[6], [6]]  # 5 was used: never again


@pytest.mark.parametrize("doomed, message", [
    ([3, 4, 5], r"removing \[3, 4, 5\] would leave stage\(s\) \[1\] without layers"),
    ([2, 9], r"cannot remove unknown layers \[9\]"),
])
def test_removing_layers_that_would_empty_a_stage_or_do_not_exist_changes_nothing(doomed, message):
    ranks = _editing_pair()
    keys, params, states = placement_snapshot(ranks)
    for r in ranks:
        with pytest.raises(ValueError, match=message):
            r.remove_layers(doomed)
    assert_unchanged(ranks, keys, params, states)
    assert all(r.placement == tuple(map(tuple, TWO)) for r in ranks)


def test_a_stage_that_gives_layers_to_both_neighbours_in_one_round():
    placement = [[0], [1, 2, 3], [4]]
    hub = Hub(3)
    ranks = [Rank(r, placement, [0, 1, 2], hub) for r in range(3)]
    want = {lid: snapshot(ranks[1].block(lid), ranks[1].optimizer) for lid in (1, 3)}
    reports = run_ranks(ranks, Plan(epoch=1, stages=((0, 1), (2,), (3, 4))))
    assert reports[1].moved == [Move(1, 0, (1,)), Move(1, 2, (3,))] and hub.votes == 1
    assert [r.keys() for r in ranks] == [{0: ["0", "1"]}, {1: ["2"]}, {2: ["3", "4"]}]
    assert_state_equal(ranks[0].block(1), ranks[0].optimizer, want[1])
    assert_state_equal(ranks[2].block(3), ranks[2].optimizer, want[3])
    assert ranks[1].optimizer_params() == [id(p) for p in ranks[1].block(2).parameters()]
