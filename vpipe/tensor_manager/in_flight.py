"""The micro-batches in flight on one stage: forwarded, their backward not ended; and the most at once.

The budget sizes what a micro-batch may keep by how many are in flight at the step's peak,
and the quiet path (:mod:`.quiet`) keeps them as the full path does, so both update this.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["InFlight"]


class InFlight:
    """``open``: the micro-batches in flight now; ``max``: the most this step, ``max_last_step``: the last's."""

    __slots__ = ("open", "max", "max_last_step", "_on_new_step")

    def __init__(self, on_new_step: Callable[[], None]) -> None:
        self.open: set[int] = set()
        self.max = 0
        self.max_last_step = 0
        self._on_new_step = on_new_step  # told at every step's first forward

    def add(self, mb: int) -> None:
        self.open.add(mb)
        self.max = max(self.max, len(self.open))

    def new_step(self) -> None:
        self.max_last_step, self.max = self.max, 0
        self._on_new_step()

    def peak(self) -> int:
        """The most in flight at once in the last step or this one (at least 1)."""
        return max(self.max_last_step, self.max, 1)
