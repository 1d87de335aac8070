"""Messages an inbox received that nobody has polled for yet, within a count and a byte cap.

The stage agent and the migration protocol share one inbox: each polls for its own types
and the rest wait here. What waits is capped, so that a flood, even from a peer holding the
run's key, cannot grow memory without bound: messages of types nobody has ever asked for go
first, then the oldest. Drops are counted (``unclaimed``) and logged at most once per
interval with their count.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Collection

from vpipe.control.messages import Message

log = logging.getLogger("vpipe.control")

__all__ = ["PendingMessages", "MAX_PENDING", "MAX_PENDING_BYTES"]

MAX_PENDING = 10_000  # decoded messages waiting for whoever polls for their type
# and their wire bytes (a decoded message takes up to ~8x its frame)
MAX_PENDING_BYTES = 1 << 20
DROP_LOG_S = 10.0


class PendingMessages:
    """Decoded messages in arrival order, with their wire sizes; ``dropped`` counts what made room.

    One queue per message type (types are the registered ones: a handful), so making room,
    taking a type and asking whether one waits never walk the other types' messages.
    """

    def __init__(self, name: str, dropped: Counter, *, max_count: int = MAX_PENDING,
                 max_bytes: int = MAX_PENDING_BYTES) -> None:
        self.name = name
        self.dropped = dropped
        self.max_count = max_count
        self.max_bytes = max_bytes
        # type -> (arrival, message, wire bytes)
        self._queues: dict[str, deque[tuple[int, Message, int]]] = {}
        self._arrivals = 0
        self._count = 0
        self.bytes = 0
        self.asked: set[str] = set()  # types someone polled for: kept before the unsolicited
        self._since_log = 0
        self._next_log = 0.0

    def __len__(self) -> int:
        return self._count

    def add(self, fresh: list[tuple[Message, int]]) -> None:
        for message, nbytes in fresh:
            self._queues.setdefault(message.type, deque()).append((self._arrivals, message, nbytes))
            self._arrivals += 1
            self._count += 1
            self.bytes += nbytes
            while self._count > self.max_count or (self.bytes > self.max_bytes and self._count > 1):
                self._make_room()

    def _make_room(self) -> None:
        """Drop the oldest message of a type nobody asked for, else the oldest of all."""
        heads = [(queue[0][0], kind) for kind, queue in self._queues.items()]
        unasked = [head for head in heads if head[1] not in self.asked]
        _, kind = min(unasked or heads)
        _, stale, nbytes = self._pop(kind)
        self._count_drop(stale, nbytes)

    def _pop(self, kind: str, index: int = 0) -> tuple[int, Message, int]:
        queue = self._queues[kind]
        item = queue.popleft() if index == 0 else queue[index]
        if index:
            del queue[index]
        if not queue:
            del self._queues[kind]
        self._count -= 1
        self.bytes -= item[2]
        return item

    def has(self, types: Collection[str] | None) -> bool:
        return self._count > 0 if types is None else any(kind in self._queues for kind in types)

    def take(self, types: Collection[str] | None) -> list[Message]:
        """Every waiting message (of ``types``, when given), in arrival order."""
        if types is not None:
            self.asked.update(types)
        kinds = list(self._queues) if types is None else [kind for kind in types if kind in self._queues]
        items = [item for kind in kinds for item in self._queues.pop(kind)]
        if len(kinds) > 1:
            items.sort(key=lambda item: item[0])
        self._count -= len(items)
        self.bytes -= sum(item[2] for item in items)
        return [item[1] for item in items]

    def take_first(self, type: str, from_rank: int | None) -> Message | None:
        self.asked.add(type)
        for i, (_, message, _) in enumerate(self._queues.get(type, ())):
            if from_rank is None or message.src == from_rank:
                return self._pop(type, i)[1]
        return None

    def _count_drop(self, stale: Message, nbytes: int) -> None:
        self.dropped["unclaimed"] += 1
        self._since_log += 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + DROP_LOG_S
            log.warning("%s: dropped %d control message(s) nobody polled for, to stay "
                        "within %d MiB (latest: %r "
                        "from rank %d, %d bytes; %d in all)", self.name, self._since_log,
                        self.max_bytes >> 20,
                        stale.type, stale.src, nbytes, self.dropped["unclaimed"])
            self._since_log = 0
