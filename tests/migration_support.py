"""In-process fakes of what a migration talks through, shared by the migration tests.

Every rank of a "run" lives in this process (on its own thread where ranks wait for each
other). A :class:`Hub` is their control plane, where each message goes through the real
encoder and decoder (so a body the migration parsers reject fails the test, as it would
fail a real ``ControlMessenger``), and their migration process group: payloads travel
through queues keyed by source, target and tag; votes meet at a ``threading.Barrier``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

import vpipe.migration.messages  # noqa: F401 - registers the migration message types with the codec
from vpipe.control.messages import decode, encode, make

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
    """:class:`~vpipe.migration.handshake.Messenger` over the hub; matches messages by key like ControlMessenger."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def send_to(self, peer: int, type: str, body: dict[str, Any], *, epoch: int) -> None:
        msg = decode(encode(make(type, body, epoch=epoch, stage=self.rank)))  # the wire format, parsers included
        with self.hub.cond:
            self.hub.log.append((self.rank, peer, msg.type, msg.body, msg.epoch))
            self.hub.mail[peer].append((self.rank, msg.type, msg.body, msg.epoch))
            self.hub.cond.notify_all()

    def wait_for(self, types: set[str], *, from_rank: int, key: tuple[int, int, int],
                 timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        box = self.hub.mail[self.rank]

        def find() -> int | None:
            return next((i for i, (src, type_, body, epoch) in enumerate(box)
                         if type_ in types and src == from_rank and (epoch, body["round"], body["move"]) == key), None)

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
    """:class:`~vpipe.migration.transfer.TransferChannel` over the hub: queues for payloads, a barrier for votes."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> _Done:
        with self.hub.cond:
            self.hub.wire.setdefault((self.rank, dst, tag), []).append(payload.clone())
            self.hub.cond.notify_all()
        return _Done()

    def recv(self, nbytes: int, src: int, tag: int) -> tuple[torch.Tensor, _Arrival]:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, _Arrival(self.hub, (src, self.rank, tag), buf)

    def vote(self, flags: list[tuple[bool, bool]]) -> list[bool]:
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
