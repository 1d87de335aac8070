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
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ArrivalPredictor", "FORWARD", "BACKWARD"]

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

    def upcoming(self, copy_seconds: Callable[[int], float]) -> list[int]:
        """Micro-batches whose backward is predicted to start within their copy time from now."""
        pos = len(self._current)
        prev = self._previous
        if not prev or pos == 0 or pos >= len(prev) or prev[pos - 1][:2] != self._current[-1][:2]:
            return []
        here = prev[pos - 1][2]
        out: list[int] = []
        for index in range(pos, len(prev)):
            kind, mb, t = prev[index]
            if kind != BACKWARD or mb in out:
                continue
            if index == pos or t - here <= copy_seconds(mb) * self.safety:
                out.append(mb)
        return out
