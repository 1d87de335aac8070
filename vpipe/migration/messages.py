"""The migration protocol's control messages, and waiting for them on the control plane.

Types: ``migrate_prepare`` (layers and their manifests), ``migrate_ready``,
``migrate_transfer`` (payload size), ``migrate_ack``, ``migrate_abort`` and
``migrate_handover`` (streamed PipeDream moves). Each body names the round and the move it
belongs to (:func:`vpipe.migration.handshake.move_key`), so a message that arrives after its
round ended (a peer that was too slow) is recognised as stale and dropped instead of being
taken for a later move's, and two moves of one round between the same ranks stay apart.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import Any

from vpipe.control.channel import ControlPlane
from vpipe.control.messages import Message, make, register_type
from vpipe.migration.state import validate_manifest
from vpipe.plan import MAX_EPOCH_STEP

log = logging.getLogger("vpipe.migration")

__all__ = ["MIGRATION_TYPES", "ControlMessenger", "HeldMessages", "MAX_HELD", "HELD_S"]

_MAX_LAYERS = 4096


def _int(value: Any, what: str, low: int = 0, high: int = 1 << 31) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def _body(body: Any, required: set[str], optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError(f"body must be a map, got {type(body).__name__}")
    keys = set(body)
    required = required | {"round", "move"}
    if not required <= keys or not keys <= required | optional:
        raise ValueError(f"body keys {sorted(map(str, keys))[:8]} do not match {sorted(required)}")
    _int(body["round"], "round", 0, 1 << 16)
    _int(body["move"], "move", 0, 1 << 18)
    return body


def _layers(value: Any) -> list[int]:
    if not isinstance(value, list) or not 0 < len(value) <= _MAX_LAYERS:
        raise ValueError(f"layers must be a list of 1..{_MAX_LAYERS} ids")
    return [_int(v, "layer id") for v in value]


def _parse_prepare(body: Any) -> dict[str, Any]:
    body = _body(body, {"src", "dst", "layers", "manifests"})
    _int(body["src"], "src", 0, 1 << 16)
    _int(body["dst"], "dst", 0, 1 << 16)
    layers = _layers(body["layers"])
    manifests = body["manifests"]
    if not isinstance(manifests, list) or len(manifests) != len(layers):
        raise ValueError("prepare needs one manifest per layer")
    for man in manifests:
        validate_manifest(man)
    return body


def _parse_handover(body: Any) -> dict[str, Any]:
    body = _body(body, {"manifests"})
    if not isinstance(body["manifests"], list) or not 0 < len(body["manifests"]) <= _MAX_LAYERS:
        raise ValueError("handover needs a list of manifests")
    for man in body["manifests"]:
        validate_manifest(man)
    return body


def _parse_transfer(body: Any) -> dict[str, Any]:
    body = _body(body, {"nbytes"})
    _int(body["nbytes"], "nbytes", 0, 1 << 62)
    return body


def _parse_abort(body: Any) -> dict[str, Any]:
    body = _body(body, {"reason"})
    if not isinstance(body["reason"], str) or len(body["reason"]) > 200:
        raise ValueError("abort reason must be a short string")
    return body


MIGRATION_TYPES = {
    "migrate_prepare": _parse_prepare,
    "migrate_ready": lambda b: _body(b, set()),
    "migrate_transfer": _parse_transfer,
    "migrate_ack": lambda b: _body(b, set()),
    "migrate_abort": _parse_abort,
    "migrate_handover": _parse_handover,
}
for _name, _parse in MIGRATION_TYPES.items():
    register_type(_name, _parse, replace=True)


MAX_HELD = 256  # migration messages kept for a move nobody waits for yet (a faster peer's next ones: a few)
HELD_S = 120.0  # ... each for at most this long (a migration step times out after 30 s by default)
DROP_LOG_S = 10.0  # drops are logged at most once per interval, with their counts


class HeldMessages:
    """Migration messages that arrived before their move was waited for, bounded in count, age and epoch.

    A message is stale (dropped) once its (epoch, round) is below the newest one waited for,
    and dropped at once when its epoch is more than ``MAX_EPOCH_STEP`` past it (no plan can
    jump that far); past ``MAX_HELD`` messages or ``HELD_S`` seconds the oldest go. Finding
    one is a dictionary look-up by (sender, epoch, round, move); dropping one never walks
    the others.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.dropped: Counter = Counter()  # by reason: stale, future_epoch, too_many, too_old
        self._arrived: OrderedDict[int, tuple[float, Message]] = OrderedDict()  # arrival number -> message
        self._by_key: dict[tuple[int, int, int, int], list[int]] = {}
        self._arrivals = 0
        self._floor: tuple[int, int] | None = None  # the newest (epoch, round) waited for
        self._since_log: Counter = Counter()
        self._next_log = 0.0

    def __len__(self) -> int:
        return len(self._arrived)

    def wait_from(self, key: tuple[int, int, int]) -> None:
        """A move ``key`` is waited for: what belongs to earlier rounds is stale (one sweep per new round)."""
        now = time.monotonic()
        while self._arrived and now - next(iter(self._arrived.values()))[0] > HELD_S:
            self._drop(next(iter(self._arrived)), "too_old")
        if self._floor is not None and key[:2] <= self._floor:
            return
        self._floor = (key[0], key[1])
        for number, (_, message) in list(self._arrived.items()):
            if (message.epoch, message.body["round"]) < self._floor:
                self._drop(number, "stale")

    def add(self, messages: list[Message]) -> None:
        now = time.monotonic()
        for message in messages:
            if self._floor is not None and (message.epoch, message.body["round"]) < self._floor:
                self._count(message, "stale")
            elif self._floor is not None and message.epoch > self._floor[0] + MAX_EPOCH_STEP:
                self._count(message, "future_epoch")
            else:
                number = self._arrivals
                self._arrivals += 1
                self._arrived[number] = (now, message)
                self._by_key.setdefault(_key_of(message), []).append(number)
                if len(self._arrived) > MAX_HELD:
                    self._drop(next(iter(self._arrived)), "too_many")

    def take(self, types: set[str], src: int, key: tuple[int, int, int]) -> Message | None:
        for number in self._by_key.get((src, *key), ()):
            message = self._arrived[number][1]
            if message.type in types:
                self._remove(number)
                return message
        return None

    def _remove(self, number: int) -> Message:
        message = self._arrived.pop(number)[1]
        key = _key_of(message)
        numbers = self._by_key[key]
        numbers.remove(number)
        if not numbers:
            del self._by_key[key]
        return message

    def _drop(self, number: int, reason: str) -> None:
        self._count(self._remove(number), reason)

    def _count(self, message: Message, reason: str) -> None:
        self.dropped[reason] += 1
        self._since_log[reason] += 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + DROP_LOG_S
            counts = ", ".join(f"{n} {r}" for r, n in sorted(self._since_log.items()))
            log.info("rank %d: dropped %s migration message(s) matching no move (latest: %s "
                     "from rank %d, epoch %d "
                     "round %d; %d so far)", self.rank, counts, message.type, message.src, message.epoch,
                     message.body["round"], self.dropped.total())
            self._since_log.clear()


def _key_of(message: Message) -> tuple[int, int, int, int]:
    return message.src, message.epoch, message.body["round"], message.body["move"]


class ControlMessenger:
    """The :class:`~vpipe.migration.handshake.Messenger` of a rank, on its control plane.

    Migration messages are taken from the plane by type, so the stage agent's stats and
    plans are never consumed here (and vice versa). Messages that match no open round wait
    in :class:`HeldMessages` until they are older than the round being waited for, then are
    dropped as stale.
    """

    def __init__(self, plane: ControlPlane, rank: int) -> None:
        self.plane = plane
        self.rank = rank
        self._held = HeldMessages(rank)

    @property
    def stale(self) -> int:
        """Messages dropped because their round had ended."""
        return int(self._held.dropped["stale"])

    @property
    def dropped(self) -> Counter:
        """Messages dropped, by reason (``stale``, ``future_epoch``, ``too_many``, ``too_old``)."""
        return self._held.dropped

    def send_to(self, peer: int, type: str, body: dict[str, Any], *, epoch: int) -> None:
        if not self.plane.send(peer, make(type, body, epoch=epoch, stage=self.rank)):
            log.warning("rank %d: could not queue %s for rank %d", self.rank, type, peer)

    def wait_for(self, types: set[str], *, from_rank: int, key: tuple[int, int, int],
                 timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        """The first ``types`` message from ``from_rank`` for ``key`` (epoch, round, move),
        or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._held.wait_from(key)
            found = self._held.take(types, from_rank, key)
            if found is not None:
                return found.type, found.body
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._held.add(self.plane.poll(timeout_ms=int(min(remaining, 0.1) * 1000) + 1,
                                           types=set(MIGRATION_TYPES)))
