"""In-process fakes of what a migration talks through, shared by the migration tests.

Every rank of a "run" lives in this process (on its own thread where ranks wait for each
other). A :class:`Hub` is their control plane, where each message goes through the real
encoder and decoder (so a body the migration parsers reject fails the test, as it would
fail a real ``ControlMessenger``), and their migration process group: payloads travel
through queues keyed by source, target and tag; votes meet at a ``threading.Barrier``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import vpipe.migration.messages  # noqa: F401 - registers the migration message types with the codec
from vpipe.control.messages import decode, encode, make
from vpipe.migration.handshake import NO_FAULTS, FaultHook
from vpipe.migration.layer_manager import LayerManager
from vpipe.migration.rounds import MigrationReport
from vpipe.plan import Plan

WIDTH = 4

class Block(nn.Module):
    def __init__(self, index: int, width: int = WIDTH) -> None:
        super().__init__()
        self.index = index  # a plain attribute: travels with a moved block, set on the clone that receives it
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


WAIT_S = 20.0  # a fake peer that has not answered by then is a bug in the test (or a deadlock)


class Hub:
    """The control plane and the migration process group of ``world`` ranks in one process."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cond = threading.Condition()
        self.mail: dict[int, list[tuple[int, str, dict[str, Any], int]]] = {r: [] for r in range(world)}
        self.log: list[tuple[int, int, str, dict[str, Any], int]] = []  # (src, dst, type, body, epoch)
        self.wire: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self.barrier = threading.Barrier(world, timeout=WAIT_S)
        self.ballots: dict[int, list[tuple[bool, bool]]] = {}
        self.votes = 0

    def messages(self, type: str | None = None) -> list[tuple[int, int, str, dict[str, Any], int]]:
        return [m for m in self.log if type is None or m[2] == type]


class FakeMessenger:
    """:class:`~vpipe.migration.handshake.Messenger` over the hub;
    matches messages by key like ControlMessenger."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def send_to(self, peer: int, type: str, body: dict[str, Any], *, epoch: int) -> None:
        # the wire format, parsers included
        msg = decode(encode(make(type, body, epoch=epoch, stage=self.rank)))
        with self.hub.cond:
            self.hub.log.append((self.rank, peer, msg.type, msg.body, msg.epoch))
            self.hub.mail[peer].append((self.rank, msg.type, msg.body, msg.epoch))
            self.hub.cond.notify_all()

    def wait_for(self, types: set[str], *, from_rank: int, key: tuple[int, int, int],
                 timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        box = self.hub.mail[self.rank]

        def find() -> int | None:
            return next((i for i, (src, type_, body, epoch) in enumerate(box)
                         if type_ in types and src == from_rank
                         and (epoch, body["round"], body["move"]) == key), None)

        with self.hub.cond:
            if not self.hub.cond.wait_for(lambda: find() is not None, timeout=timeout_s):
                return None
            _, type_, body, _ = box.pop(find())  # type: ignore[arg-type]
            return type_, body


class _Done:
    def wait(self, *_: Any) -> None:
        return None


class _Arrival:
    def __init__(self, hub: Hub, key: tuple[int, int, int], buf: torch.Tensor) -> None:
        self.hub, self.key, self.buf = hub, key, buf

    def wait(self, *_: Any) -> None:
        with self.hub.cond:
            if not self.hub.cond.wait_for(lambda: self.hub.wire.get(self.key), timeout=WAIT_S):
                raise TimeoutError(f"nothing arrived for (src, dst, tag) {self.key}")
            payload = self.hub.wire[self.key].pop(0)
        if payload.numel() != self.buf.numel():
            raise AssertionError(f"{payload.numel()} bytes sent, {self.buf.numel()} expected for {self.key}")
        self.buf.copy_(payload)


class FakeChannel:
    """:class:`~vpipe.migration.transfer.TransferChannel` over the
    hub: queues for payloads, a barrier for votes."""

    timeout_s = 1800.0  # torch's default for a group

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def close(self) -> None:
        pass

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> _Done:
        with self.hub.cond:
            self.hub.wire.setdefault((self.rank, dst, tag), []).append(payload.clone())
            self.hub.cond.notify_all()
        return _Done()

    def recv(self, nbytes: int, src: int, tag: int) -> tuple[torch.Tensor, _Arrival]:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, _Arrival(self.hub, (src, self.rank, tag), buf)

    def vote(self, flags: list[tuple[bool, bool]], *, timeout_s: float | None = None,
             what: str = "a vote") -> list[bool]:
        hub = self.hub
        hub.ballots[self.rank] = list(flags)
        if hub.barrier.wait() == 0:
            hub.votes += 1
        ballots = [hub.ballots[r] for r in range(hub.world)]
        out = [all(b[i][0] for b in ballots) if all_of else any(b[i][0] for b in ballots)
               for i, (_, all_of) in enumerate(flags)]
        hub.barrier.wait()  # everyone has read the ballots before the next vote overwrites them
        return out


class Recorder:
    """A listener (tensor manager, monitor) that writes down what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, nn.Module | None]] = []

    def add_layer(self, layer_id: int, module: nn.Module) -> None:
        self.events.append(("add", layer_id, module))

    def remove_layer(self, layer_id: int) -> None:
        self.events.append(("remove", layer_id, None))

    def retire_layer(self, layer_id: int) -> None:
        self.events.append(("retire", layer_id, None))




class Rank:
    """One rank: its stages' containers, optimizer, listeners and layer manager."""

    def __init__(self, rank: int, placement: Sequence[Sequence[int]], stage_ranks: Sequence[int], hub: Hub, *,
                 kind: type[Block] = Block, factory: Callable[[int, Any], nn.Module] | None = None,
                 specs: dict[int, Any] | None = None, faults: FaultHook = NO_FAULTS,
                 timeout_s: float = WAIT_S,
                 epoch: int = 0) -> None:
        torch.manual_seed(100 + rank)
        local = [v for v, r in enumerate(stage_ranks) if r == rank]
        self.containers = {v: nn.Sequential(OrderedDict((str(lid), kind(lid)) for lid in placement[v]))
                           for v in local}
        self.optimizer = torch.optim.Adam([p for c in self.containers.values() for p in c.parameters()],
                                          lr=0.01)
        self.manager = LayerManager(self.containers, placement=placement, optimizer=self.optimizer,
                                    factory=factory,
                                    specs=specs, messenger=FakeMessenger(hub, rank),
                                    channel=FakeChannel(hub, rank),
                                    device=torch.device("cpu"), stage_ranks=stage_ranks, timeout_s=timeout_s,
                                    epoch=epoch, faults=faults)
        self.placement = tuple(tuple(s) for s in placement)  # this rank's plan in force: where the layers are
        self.listeners = {v: Recorder() for v in local}
        for v, listener in self.listeners.items():
            self.manager.listeners[v].append(listener)
        self.train_step()  # optimizer state to move, and the boundary shapes the manager watches

    def train_step(self) -> None:
        for container in self.containers.values():
            h = torch.randn(2, WIDTH)
            for block in container:
                h = block(h)
            h.square().sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def apply(self, plan: Plan) -> MigrationReport:
        """Move towards ``plan`` from the placement in force, and
        keep the one reached (as the plan applier does)."""
        report = self.manager.apply(plan, self.placement)
        self.placement = report.placement
        return report

    def add_layers(self, position: int, specs: Sequence[Any]) -> list[int]:
        new_ids, self.placement = self.manager.add_layers(self.placement, position, specs)
        return new_ids

    def remove_layers(self, layer_ids: Sequence[int]) -> bool:
        reshapes, self.placement = self.manager.remove_layers(self.placement, layer_ids)
        return reshapes

    def block(self, layer_id: int) -> nn.Module:
        return next(c._modules[str(layer_id)] for c in self.containers.values()
                    if str(layer_id) in c._modules)

    def keys(self) -> dict[int, list[str]]:
        return {v: list(c._modules) for v, c in self.containers.items()}

    def optimizer_params(self) -> list[int]:
        return [id(p) for group in self.optimizer.param_groups for p in group["params"]]


def run_ranks(ranks: Sequence[Rank | LayerManager], plan: Plan,
              start: Sequence[Sequence[int]] = ()) -> list[MigrationReport]:
    """Every rank applies ``plan`` at the same step boundary, each on its own thread: a :class:`Rank` from the
    placement it keeps, a bare layer manager from ``start``."""
    owners = {id(r.manager): r for r in ranks if isinstance(r, Rank)}
    return on_every_rank(ranks, lambda manager: owners[id(manager)].apply(plan) if id(manager) in owners
                         else manager.apply(plan, start))


def on_every_rank(ranks: Sequence[Rank | LayerManager], call: Callable[[LayerManager], Any]) -> list[Any]:
    """``call(manager)`` on every rank at once, each on its own
    thread (a collective inside it needs them all)."""
    managers = [r.manager if isinstance(r, Rank) else r for r in ranks]
    reports: list[Any] = [None] * len(managers)

    def apply(i: int) -> None:
        torch.set_num_threads(1)
        try:
            reports[i] = call(managers[i])
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            reports[i] = e

    threads = [threading.Thread(target=apply, args=(i,), daemon=True) for i in range(len(managers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * WAIT_S)
    assert not any(t.is_alive() for t in threads), "a rank never finished applying the plan"
    for r in reports:
        if isinstance(r, BaseException):
            raise r
    return reports


TWO = [[0, 1, 2], [3, 4, 5]]


# ---------------------------------------------------------------------- moves that fail
def assert_unchanged(ranks: Sequence[Rank], keys: list[dict], params: list[list[int]],
                     states: list[dict]) -> None:
    """Every rank's containers, optimizer (parameters and state) and listeners are as they were."""
    for rank, k, p, s in zip(ranks, keys, params, states):
        assert rank.keys() == k
        assert rank.optimizer_params() == p
        assert sorted(id(q) for q in rank.optimizer.state) == sorted(s)
        for q, st in rank.optimizer.state.items():
            assert sorted(st) == sorted(s[id(q)]) and all(torch.equal(v, s[id(q)][kk])
                                                          for kk, v in st.items())
        assert all(not listener.events for listener in rank.listeners.values())


def placement_snapshot(ranks: Sequence[Rank]) -> tuple[list, list, list]:
    return ([r.keys() for r in ranks], [r.optimizer_params() for r in ranks],
            [{id(q): {k: v.clone() for k, v in st.items()} for q, st in r.optimizer.state.items()}
             for r in ranks])
