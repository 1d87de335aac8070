"""The micro-batches in flight on one stage: forwarded, their backward not ended; and the most at once.

The budget sizes what a micro-batch may keep by how many are in flight at the step's peak,
and the quiet path (:mod:`.quiet`) keeps them as the full path does, so both tell this of
every forward and backward that starts. It passes each action on to the schedule's learned
order (:class:`.prefetch.ArrivalPredictor`), which says when a new step begins: a micro-batch
id that comes round again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from vpipe.tensor_manager.prefetch import BACKWARD, FORWARD

__all__ = ["InFlight", "ActionOrder"]


class ActionOrder(Protocol):
    """Learns the step's order of actions (:class:`.prefetch.ArrivalPredictor`)."""

    def observe(self, kind: str, mb: int) -> bool:
        """An action of ``mb`` starts now; True if it begins a new step."""


class InFlight:
    """``open``: the micro-batches in flight now; ``max``: the most
    this step, ``max_last_step``: the last's."""

    __slots__ = ("open", "max", "max_last_step", "_order", "_on_new_step")

    def __init__(self, order: ActionOrder, on_new_step: Callable[[], None]) -> None:
        self.open: set[int] = set()
        self.max = 0
        self.max_last_step = 0
        self._order = order
        self._on_new_step = on_new_step  # told at every step's first forward

    def forward_starts(self, mb: int) -> None:
        """A forward of ``mb`` starts (an evaluation forward too): at a new
        step, remember how many were in flight in the last."""
        if self._order.observe(FORWARD, mb):
            self.max_last_step, self.max = self.max, 0
            self._on_new_step()

    def backward_starts(self, mb: int) -> None:
        """A backward phase of ``mb`` starts."""
        self._order.observe(BACKWARD, mb)

    def add(self, mb: int) -> None:
        """``mb``'s forward, which saves tensors for a backward, runs now."""
        self.open.add(mb)
        self.max = max(self.max, len(self.open))

    def ended(self, mb: int) -> None:
        """``mb``'s backward is over (its full or weight pass ended)."""
        self.open.discard(mb)

    def forget(self) -> None:
        """The backwards of the micro-batches in flight will not be seen (a stream's stage runs without the
        manager from now)."""
        self.open.clear()

    def peak(self) -> int:
        """The most in flight at once in the last step or this one (at least 1)."""
        return max(self.max_last_step, self.max, 1)
