"""When to bring swapped activations back: the schedule's order and the predicted arrival.

A pipeline schedule repeats the same order of forward and backward actions every step
(GPipe: all forwards then all backwards; 1F1B: warm-up, then alternating; zero-bubble:
input and weight backwards apart). The predictor learns that order, with the time of each
action relative to the step start, from the previous step. At every action boundary it
answers: which micro-batches' backwards start soon enough that their host->device copy
must begin now? "Soon enough" is the predicted copy time (bytes over the measured copy
bandwidth) with a safety factor; a backward that is the very next action is always
included, so its copy overlaps at least the action before it.

Before the first step is learned, or when the order deviates from the learned one (a new
plan, a different schedule), nothing is predicted and each backward prefetches its own
micro-batch when it starts.

The :class:`Prefetcher` asks at every action boundary (and again at the next unpack when
the budget held a prefetch back) and issues the copies, stopping at the budget less the
backward's reserve.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vpipe.tensor_manager.copy_engine import H2D
from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.phases import BackwardPhases
from vpipe.tensor_manager.swap_in import SwapIn

__all__ = ["ArrivalPredictor", "Prefetcher", "FORWARD", "BACKWARD"]

FORWARD = "F"
BACKWARD = "B"


class ArrivalPredictor:
    """Learns the per-step action order and timing; predicts the backwards that need a prefetch."""

    def __init__(self, safety: float = 1.5, clock: Callable[[], float] = time.perf_counter) -> None:
        self.safety = safety
        self._clock = clock
        self._previous: list[tuple[str, int, float]] = []
        self._current: list[tuple[str, int, float]] = []
        self._forwarded: set[int] = set()
        self._step_start = clock()

    @property
    def learned(self) -> bool:
        return bool(self._previous)

    def observe(self, kind: str, mb: int) -> bool:
        """An action (forward or backward phase of ``mb``) starts now; True if it begins a new step."""
        now = self._clock()
        new_step = kind == FORWARD and mb in self._forwarded  # a micro-batch id comes round again
        if new_step:
            self._previous = self._current
            self._current = []
            self._forwarded.clear()
            self._step_start = now
        if kind == FORWARD:
            self._forwarded.add(mb)
        self._current.append((kind, mb, now - self._step_start))
        return new_step

    def _next_position(self) -> int | None:
        """Where the next action falls in the learned order: None before it is learned, past its end, or when
        this step's last action is not the learned one at that place (the order changed)."""
        pos = len(self._current)
        prev = self._previous
        if not prev or pos == 0 or pos >= len(prev) or prev[pos - 1][:2] != self._current[-1][:2]:
            return None
        return pos

    def backward_follows(self, mb: int) -> bool:
        """Whether, in the learned order, the action after the forward of ``mb`` starting now is ``mb``'s own
        backward (the last micro-batch when the backwards start from it, every micro-batch of 1F1B's last
        stage)."""
        pos = self._next_position()
        return pos is not None and self._previous[pos][:2] == (BACKWARD, mb)

    def backward_first(self, mb: int) -> bool:
        """Whether, in the learned order, ``mb``'s backward comes before the backwards of every micro-batch
        forwarded after it (first in, first out: torch's GPipe and 1F1B; not backwards from the last)."""
        forwards = [m for kind, m, _ in self._previous if kind == FORWARD]
        if mb not in forwards:
            return False
        later = set(forwards[forwards.index(mb) + 1:])
        for kind, m, _ in self._previous:
            if kind == BACKWARD and (m == mb or m in later):
                return m == mb
        return False

    def upcoming(self, copy_seconds: Callable[[int], float],
                 most_seconds: Callable[[int], float] | None = None) -> list[int]:
        """Micro-batches whose backward is predicted to start within their copy time from now.

        ``most_seconds``, if given, is a cheap upper bound of ``copy_seconds``: the exact copy time
        (a walk over the micro-batch's entries) is asked only where the bound could bring it in.
        """
        pos = self._next_position()
        if pos is None:
            return []
        prev = self._previous
        here = prev[pos - 1][2]
        out: list[int] = []
        for index in range(pos, len(prev)):
            kind, mb, t = prev[index]
            if kind != BACKWARD or mb in out:
                continue
            ahead = (t - here) / self.safety
            if index == pos or ((most_seconds is None or ahead <= most_seconds(mb))
                                and ahead <= copy_seconds(mb)):
                out.append(mb)
        return out


class Prefetcher:
    """Issues the prefetches the schedule's order (``order``, told of every action by the manager's
    :class:`.in_flight.InFlight`) and the predicted arrival times call for."""

    def __init__(self, swap_in: SwapIn, phases: BackwardPhases, budget: BudgetGovernor,
                 order: ArrivalPredictor) -> None:
        self._swap_in = swap_in
        self._phases = phases
        self._budget = budget
        self._order = order
        self.throttled = False  # the last pump stopped at the budget: pump again at the next unpack

    def pump(self) -> None:
        """Issue the prefetches the schedule's order and the predicted arrival times call for now."""
        swap_in = self._swap_in
        if not swap_in.engine.has_pool:
            return
        phases = self._phases
        bandwidth = swap_in.copies.expected_bandwidth(H2D)
        swapped_bytes = swap_in.engine.swapped_bytes
        targets = [mb for mb, _ in phases.running[-1:]] + self._order.upcoming(
            lambda mb: swap_in.host_bytes(mb, mb in phases.lagging) / bandwidth,
            lambda mb: swapped_bytes.get(mb, 0) / bandwidth)
        limit = self._budget.limit()
        throttled = False
        for mb in dict.fromkeys(targets):
            if not swap_in.prefetch(mb, limit, phases.fetch_phase(mb)):
                throttled = True
                break
        self.throttled = throttled

    def prefetch(self, mb: int) -> bool:
        """Start bringing ``mb``'s swapped tensors back now; False if the budget held some back."""
        return self._swap_in.prefetch(mb, self._budget.limit(), self._phases.fetch_phase(mb))
