"""Streamed moves inside a PipeDream stream, source and target driven by hand through the schedule's hooks,
and the layer manager starting them (both ranks on threads).

:class:`FakeSchedule` is what the movers use of :class:`~vpipe.schedules.pipedream.SchedulePipeDream`
(the stage's place, the update count, the stashed weight versions, the parameters still
updated after leaving the forward). The hooks are called in the order the schedule calls
them; payloads and the hand-over message go through :mod:`migration_support`'s fakes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from support.migration import FakeChannel, FakeMessenger, Hub, Recorder
from vpipe.migration.handshake import NO_FAULTS, MigrationError
from vpipe.migration.layer_manager import LayerManager
from vpipe.migration.state import pack_layer
from vpipe.migration.stream import IncomingStream, OutgoingStream, version_window
from vpipe.plan import Plan
from vpipe.schedules.pipedream import start_version
from vpipe.stage.blocks import KeyStyle, StageBlocks

KEY = (1, 0, 1)  # epoch 1, round 0, move 2 * src + forward


class FakeSchedule:
    def __init__(self, stage_index: int, num_stages: int, optimizer: torch.optim.Optimizer, *, updates: int,
                 next_fwd: int, vertical_sync: bool = False) -> None:
        self._stage = SimpleNamespace(stage_index=stage_index, num_stages=num_stages,
                                      device=torch.device("cpu"))
        self.optimizer = optimizer
        self.updates = updates
        self._next_fwd = next_fwd
        self.vertical_sync = vertical_sync
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self.departing: dict[str, nn.Parameter] = {}
        self.deferred: list[tuple[object, torch.Tensor]] = []

    @property
    def next_forward(self) -> int:
        return self._next_fwd

    @property
    def stream_updates(self) -> int:
        return self.updates

    def streams_stage(self, stage_index: int) -> bool:
        return True

    def stashed(self, version: int) -> dict[str, torch.Tensor] | None:
        return self._versions.get(version)

    def move_versions(self, switch_mb: int, stage_index: int) -> range:
        return version_window(switch_mb, stage_index, self._stage.num_stages, self.vertical_sync)

    def updates_before(self, mb: int) -> int:
        return mb

    @property
    def upcoming_version(self) -> int:
        return start_version(self._next_fwd, self._stage.stage_index, self._stage.num_stages,
                             self.vertical_sync)

    def defer_wait(self, work: object, payload: torch.Tensor) -> None:
        self.deferred.append((work, payload))


class Side:
    """One stage: a container keyed by layer id, its optimizer (SGD
    with momentum: state to move) and schedule."""

    def __init__(self, stage: int, ids: list[int], num_stages: int, *, updates: int, next_fwd: int,
                 vertical_sync: bool = False, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.container = nn.Sequential(OrderedDict((str(i), nn.Linear(4, 4)) for i in ids))
        self.blocks = StageBlocks(self.container, ids, KeyStyle.IDS)
        self.optimizer = torch.optim.SGD(self.container.parameters(), lr=0.1, momentum=0.9)
        self.schedule = FakeSchedule(stage, num_stages, self.optimizer, updates=updates, next_fwd=next_fwd,
                                     vertical_sync=vertical_sync)
        self.listener = Recorder()

    def update(self) -> None:
        """The optimizer step of one micro-batch (PipeDream steps per micro-batch)."""
        self.container(torch.randn(2, 4)).square().sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.updates += 1

    def stash(self) -> None:
        """Keep the current weights as the version of the current update count."""
        self.schedule._versions[self.schedule.updates] = {n: p.detach().clone()
                                                          for n, p in self.container.named_parameters()}


def _pair(num_stages: int, switch_mb: int, *, updates: int, vertical_sync: bool = False, stash=()):
    hub = Hub(2)
    src = Side(0, [0, 1, 2], num_stages, updates=0, next_fwd=0, vertical_sync=vertical_sync, seed=0)
    dst = Side(1, [3, 4], num_stages, updates=0, next_fwd=0, vertical_sync=vertical_sync, seed=1)
    for _ in range(updates):
        if src.schedule.updates in stash:
            src.stash()
        src.update()
    src.schedule._next_fwd = min(updates + 1, switch_mb - 1)  # forwarded ahead of its updates, not yet S
    moving = src.container._modules["2"]
    out = OutgoingStream(src.schedule, src.blocks, {2: moving}, forward=True, switch_mb=switch_mb, dst=1,
                         key=KEY,
                         channel=FakeChannel(hub, 0), messenger=FakeMessenger(hub, 0), stage_index=0,
                         listeners=[src.listener])
    arriving = nn.Linear(4, 4)
    inc = IncomingStream(dst.schedule, dst.blocks, {2: arriving}, [pack_layer(2, moving, None).manifest],
                         forward=True, switch_mb=switch_mb, src=0, key=KEY, channel=FakeChannel(hub, 1),
                         messenger=FakeMessenger(hub, 1), timeout_s=0.3, stage_index=1,
                         device=torch.device("cpu"), listeners=[dst.listener])
    return hub, src, dst, out, inc, moving, arriving


def test_the_target_gets_the_switch_version_and_then_the_live_state_and_the_source_lets_go():
    hub, src, dst, out, inc, moving, arriving = _pair(2, switch_mb=4, updates=2)
    # the target's first forward (micro-batch 4) runs version 4
    assert list(out.window) == list(inc.window) == [4]
    assert not hub.wire and out.bytes_sent == 0  # version 4 does not exist yet
    src.update()  # update 3
    out.after_update(3)
    assert not hub.wire
    # micro-batch 4's forward: the layer leaves the source's forward,
    # its in-flight micro-batches still update it
    out.before_forward(4)
    assert list(src.container._modules) == ["0", "1"] and set(src.schedule.departing) == {"2.weight",
                                                                                          "2.bias"}
    assert src.schedule.departing["2.weight"] is moving.weight and not out.done
    src.update()  # update 4 (micro-batch 3's backward): the departing layer is updated one last time
    live = {n: p.detach().clone() for n, p in moving.named_parameters()}
    momentum = {n: src.optimizer.state[p]["momentum_buffer"].clone() for n, p in moving.named_parameters()}
    out.after_update(4)  # version 4 goes, then the hand-over
    assert out.done and src.schedule.departing == {}
    assert not {id(p) for p in moving.parameters()} & {id(p) for g in src.optimizer.param_groups
                                                       for p in g["params"]}
    assert not any(p in src.optimizer.state for p in moving.parameters())
    # the listeners heard the layer leave the forward path at the switch, and go at the hand-over
    assert src.listener.events == [("retire", 2, None), ("remove", 2, None)]
    assert [m[2] for m in hub.log] == ["migrate_handover"] and hub.log[0][3]["manifests"][0]["layer"] == 2

    inc.before_forward(3)
    assert list(dst.container._modules) == ["3", "4"]
    inc.before_forward(4)
    assert list(dst.container._modules) == ["2", "3", "4"] and dst.container._modules["2"] is arriving
    weights: dict[str, torch.Tensor] = {}
    inc.add_weights(3, weights)
    assert weights == {}  # not a version of the window: the target's own
    inc.add_weights(4, weights)
    assert sorted(weights) == ["2.bias", "2.weight"]
    assert all(torch.equal(weights[f"2.{n}"], live[n]) for n in live)
    assert all(weights[n].requires_grad for n in weights)
    inc.before_update(4)  # before the target applies the update of micro-batch 4: the live state arrives
    assert all(torch.equal(p.detach(), live[n]) for n, p in arriving.named_parameters())
    assert all(torch.equal(dst.optimizer.state[p]["momentum_buffer"], momentum[n])
               for n, p in arriving.named_parameters())
    assert {id(p) for p in arriving.parameters()} <= {id(p) for g in dst.optimizer.param_groups
                                                      for p in g["params"]}
    assert dst.listener.events == [("add", 2, arriving)]
    assert out.bytes_sent == inc.bytes_received == 2 * 20 * 4 + 20 * 4  # version 4, then weights and momentum
    dst.schedule._next_fwd = 4
    assert not inc.done  # micro-batch 4 may still be forwarded on version 4
    dst.schedule._next_fwd = 5
    assert inc.done


def test_under_vertical_sync_versions_already_made_go_at_once_from_the_stash():
    # 4 stages, target stage 1: micro-batch 8 starts on version 8 - 4 + 1 = 5; versions 5 and 6 exist already
    hub, src, dst, out, inc, moving, arriving = _pair(4, switch_mb=8, updates=7, vertical_sync=True,
                                                      stash=(5, 6))
    assert list(out.window) == [5, 6, 7, 8]
    stashed = {v: {n: src.schedule._versions[v][f"2.{n}"] for n in ("weight", "bias")} for v in (5, 6)}
    # 5 and 6 from the stash, 7 live, at registration
    assert len(hub.wire) == 3 and out.bytes_sent == 3 * 20 * 4
    live7 = {n: p.detach().clone() for n, p in moving.named_parameters()}
    out.before_forward(8)
    src.update()
    out.after_update(8)
    assert out.done
    inc.before_forward(8)
    for v, want in (*stashed.items(), (7, live7)):
        weights: dict[str, torch.Tensor] = {}
        inc.add_weights(v, weights)
        assert all(torch.equal(weights[f"2.{n}"], want[n]) for n in want), v
    weights = {}
    inc.add_weights(8, weights)
    assert all(torch.equal(weights[f"2.{n}"], p.detach()) for n, p in moving.named_parameters())
    inc.before_update(8)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(arriving.parameters(),
                                                                   moving.parameters()))
    assert out.bytes_sent == inc.bytes_received


def test_a_move_registered_too_late_or_after_its_versions_were_dropped_is_refused():
    hub = Hub(2)
    side = Side(0, [0, 1, 2], 4, updates=7, next_fwd=8, vertical_sync=True)
    layer = {2: side.container._modules["2"]}
    kwargs = dict(forward=True, dst=1, key=KEY, channel=FakeChannel(hub, 0), messenger=FakeMessenger(hub, 0),
                  stage_index=0)
    with pytest.raises(RuntimeError,
                       match="^streamed move registered too late: micro-batch 8 already started$"):
        OutgoingStream(side.schedule, side.blocks, layer, switch_mb=8, **kwargs)
    side.schedule._next_fwd = 7
    side.schedule._versions = {6: {}}  # version 5 was released already
    with pytest.raises(RuntimeError, match=r"^stage 0: weight version 5 of layers \[2\] is no longer kept; "
                                           "register the move earlier$"):
        OutgoingStream(side.schedule, side.blocks, layer, switch_mb=8, **kwargs)
    assert not hub.wire


def test_a_target_whose_source_never_hands_over_stops_naming_it():
    hub, src, dst, out, inc, moving, arriving = _pair(2, switch_mb=4, updates=2)
    with pytest.raises(RuntimeError, match=r"^stage 1: rank 0 never handed over layers \[2\] \(epoch 1\)$"):
        inc.before_update(4)
    FakeMessenger(hub, 0).send_to(1, "migrate_handover", {"round": 0, "move": 1,
                                                          "manifests": [pack_layer(1, nn.Linear(4, 4),
                                                                                   None).manifest]},
                                  epoch=1)
    with pytest.raises(RuntimeError, match=r"^hand-over of layers \[1\], expected \[2\]$"):
        inc.before_update(4)
    inc.before_update(3)  # not the switch: nothing to wait for


def test_the_version_window_follows_the_weight_stashing_rule():
    # one micro-batch in flight on stage 1 of 2
    assert list(version_window(4, 1, 2, vertical_sync=False)) == [4]
    assert list(version_window(8, 1, 4, vertical_sync=False)) == [6, 7, 8]
    assert list(version_window(8, 1, 4, vertical_sync=True)) == [5, 6, 7, 8]
    assert list(version_window(1, 0, 4, vertical_sync=True)) == [0, 1]  # never before version 0


# --------------------------------------------------------------- starting a streamed move (the layer manager)
def _streaming_ranks(run_forward: bool = True, faults=None):
    """Two single-stage ranks with layer managers, mid-stream: 2 updates applied, micro-batch 3 forwarded."""
    hub = Hub(2)
    sides, managers = [], []
    for rank, ids in enumerate(([0, 1, 2], [3, 4])):
        side = Side(rank, ids, 2, updates=2, next_fwd=3, seed=rank)
        side.schedule.movers = []
        manager = LayerManager(side.container, placement=[[0, 1, 2], [3, 4]], optimizer=side.optimizer,
                               factory=None,
                               specs=None, messenger=FakeMessenger(hub, rank), channel=FakeChannel(hub, rank),
                               device=torch.device("cpu"), stage_index=rank, timeout_s=0.5,
                               faults=faults if faults is not None and rank == 1 else NO_FAULTS)
        manager.listeners[rank].append(side.listener)
        if run_forward:
            side.container(torch.randn(2, 4))  # the boundary shapes the manager checks before streaming
        sides.append(side)
        managers.append(manager)
    return hub, sides, managers


def _start(managers, sides, plan, switch_mb=4):
    results: list = [None, None]

    def go(i: int) -> None:
        try:
            results[i] = managers[i].start_streamed(plan, ((0, 1, 2), (3, 4)), sides[i].schedule, switch_mb)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_a_streamed_move_starts_on_both_ranks_and_completes_through_the_schedule_hooks():
    hub, (src, dst), managers = _streaming_ranks()
    moving = src.container._modules["2"]
    plan = Plan(epoch=1, stages=((0, 1), (2, 3, 4)))
    (outgoing, reached), (incoming, reached_too) = _start(managers, [src, dst], plan)
    assert [type(m) for m in outgoing] == [OutgoingStream] and [type(m) for m in incoming] == [IncomingStream]
    assert src.schedule.movers == outgoing and dst.schedule.movers == incoming
    assert reached == reached_too == ((0, 1), (2, 3, 4))  # the round's placement, at once
    assert [(m[0], m[1], m[2]) for m in hub.log] == [(0, 1, "migrate_prepare"), (1, 0, "migrate_ready")]
    assert hub.votes == 2  # the boundary check, then "every target ready"
    out, inc = outgoing[0], incoming[0]
    # nothing has moved yet: the switch is at micro-batch 4
    assert list(src.container._modules) == ["0", "1", "2"] and list(dst.container._modules) == ["3", "4"]
    src.update()
    out.after_update(3)
    out.before_forward(4)
    src.update()
    out.after_update(4)
    inc.before_forward(4)
    inc.add_weights(4, {})
    inc.before_update(4)
    arrived = dst.container._modules["2"]
    assert list(src.container._modules) == ["0", "1"] and list(dst.container._modules) == ["2", "3", "4"]
    assert managers[0].layer_ids == [0, 1] and managers[1].layer_ids == [2, 3, 4]
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(arrived.parameters(), moving.parameters()))
    assert src.listener.events == [("retire", 2, None), ("remove", 2, None)]
    assert dst.listener.events == [("add", 2, arrived)]
    # the shapes followed: the target learned them from the source (a move back may come before layer 2 runs
    # there), so it watches nothing; the source stopped watching
    assert managers[1].shapes.out_meta[2] == managers[0].shapes.out_meta[2]
    assert 2 not in managers[1].shapes._hooks and 2 not in managers[0].shapes._hooks


def test_a_streamed_move_whose_target_is_not_ready_starts_nowhere():
    hub, sides, managers = _streaming_ranks(faults=lambda point: True)
    results = _start(managers, sides, Plan(epoch=1, stages=((0, 1), (2, 3, 4))))
    assert results == [([], ((0, 1, 2), (3, 4)))] * 2  # no movers, the layers where they were
    assert all(s.schedule.movers == [] for s in sides)
    assert [list(s.container._modules) for s in sides] == [["0", "1", "2"], ["3", "4"]]


def test_a_streamed_move_of_a_block_with_a_user_hook_is_refused_at_once_and_starts_nowhere(caplog):
    hub, sides, managers = _streaming_ranks()
    sides[0].container._modules["2"].register_forward_hook(lambda module, args, output: output)
    with caplog.at_level(logging.INFO, logger="vpipe"):
        results = _start(managers, sides, Plan(epoch=1, stages=((0, 1), (2, 3, 4))))
    assert results == [([], ((0, 1, 2), (3, 4)))] * 2 and all(s.schedule.movers == [] for s in sides)
    assert [list(s.container._modules) for s in sides] == [["0", "1", "2"], ["3", "4"]]
    # no prepare: the target is told
    assert [(m[0], m[1], m[2]) for m in hub.log] == [(0, 1, "migrate_abort")]
    refused = [r.getMessage() for r in caplog.records
               if getattr(r, "vpipe_fields", {}).get("event") == "migration_refused"]
    assert len(refused) == 1 and refused[0].startswith("stage 0 cannot send layers [2]: layer 2 "
                                                       "carries forward hook")


def test_a_streamed_move_that_changes_a_boundary_shape_is_refused_on_every_rank():
    hub, sides, managers = _streaming_ranks(run_forward=False)  # stage 0 never ran: its boundary is unknown
    results = _start(managers, sides, Plan(epoch=1, stages=((0, 1), (2, 3, 4))))
    for r in results:
        assert isinstance(r, MigrationError) and str(r).startswith(
            "this move changes a boundary activation's shape; a PipeDream stream cannot resize its buffers")
    assert not hub.log


def test_a_new_streamed_move_waits_for_the_last_one():
    _, (src, _), managers = _streaming_ranks()
    src.schedule.movers = [SimpleNamespace(done=False)]
    with pytest.raises(MigrationError,
                       match="^a streamed move is still in progress; wait for it before the next plan$"):
        managers[0].start_streamed(Plan(epoch=1, stages=((0, 1), (2, 3, 4))), ((0, 1, 2), (3, 4)),
                                   src.schedule, 4)
    assert managers[0].epoch == 0
