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
    """Decoded messages in arrival order, with their wire sizes; ``dropped`` counts what made room."""

    def __init__(self, name: str, dropped: Counter, *, max_count: int = MAX_PENDING,
                 max_bytes: int = MAX_PENDING_BYTES) -> None:
        self.name = name
        self.dropped = dropped
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.items: deque[tuple[Message, int]] = deque()
        self.bytes = 0
        self.asked: set[str] = set()  # types someone polled for: kept before the unsolicited
        self._since_log = 0
        self._next_log = 0.0

    def __len__(self) -> int:
        return len(self.items)

    def add(self, fresh: list[tuple[Message, int]]) -> None:
        for item in fresh:
            self.items.append(item)
            self.bytes += item[1]
            while len(self.items) > self.max_count or (self.bytes > self.max_bytes and len(self.items) > 1):
                victim = next((i for i, (m, _) in enumerate(self.items) if m.type not in self.asked), 0)
                stale, nbytes = self.items[victim]
                del self.items[victim]
                self.bytes -= nbytes
                self._count(stale, nbytes)

    def has(self, types: Collection[str] | None) -> bool:
        return any(types is None or m.type in types for m, _ in self.items)

    def take(self, types: Collection[str] | None) -> list[Message]:
        """Every waiting message (of ``types``, when given), in arrival order."""
        if types is None:
            out = [m for m, _ in self.items]
            self.items.clear()
            self.bytes = 0
            return out
        self.asked.update(types)
        out = [m for m, _ in self.items if m.type in types]
        if out:
            self.items = deque((m, n) for m, n in self.items if m.type not in types)
            self.bytes = sum(n for _, n in self.items)
        return out

    def take_first(self, type: str, from_rank: int | None) -> Message | None:
        self.asked.add(type)
        for i, (message, nbytes) in enumerate(self.items):
            if message.type == type and (from_rank is None or message.src == from_rank):
                del self.items[i]
                self.bytes -= nbytes
                return message
        return None

    def _count(self, stale: Message, nbytes: int) -> None:
        self.dropped["unclaimed"] += 1
        self._since_log += 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + DROP_LOG_S
            log.warning("%s: dropped %d control message(s) nobody polled for, to stay within %d MiB (latest: %r "
                        "from rank %d, %d bytes; %d in all)", self.name, self._since_log, self.max_bytes >> 20,
                        stale.type, stale.src, nbytes, self.dropped["unclaimed"])
            self._since_log = 0
