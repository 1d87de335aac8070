"""A rank's pulse: every step's forward time of its stage modules, and the changes it reveals.

The monitors measure each block only on sampled steps, and sample rarely once nothing changes
(:mod:`vpipe.monitors.sampling`). What changes while training runs would then wait for the
next sample: a device that slows down (a straggler, a GPU shared with another job) or
recovers, a sequence length that grows, blocks frozen part-way. The pulse watches for these
on every step at the cost of two hooks per stage module (no per-block hooks) and one count of
trainable parameters:

- the stage modules' forward time per micro-batch, against the median of the steps since
  the last change: when each of the last ``confirm`` steps is more than ``threshold`` away
  from it on the same side (all slower or all faster), that is a change (a busy core slows
  some steps, not every one);
- the number of parameters that train: freezing (or unfreezing) blocks changes their
  backward's work without touching the forward.

A change is reported once (:meth:`StagePulse.end_step` returns it) and the watch starts over
from the new level; the session sends it to the planner, which has every rank measure its
blocks again. Sampled steps are not judged (their per-block hooks add time), nor the first
step after a start or a plan (one-off costs).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vpipe.monitors.clock import CudaClock, clock_for

__all__ = ["StagePulse", "PulseChange", "trains"]


def trains(module: nn.Module) -> bool:
    """Whether a block has a parameter that trains (a block without parameters has nothing frozen)."""
    params = list(module.parameters())
    return not params or any(p.requires_grad for p in params)


@dataclass(frozen=True)
class PulseChange:
    """What the pulse saw change: ``ratio`` is the new forward time over the old (1.0 for a freeze)."""

    what: str
    ratio: float


class StagePulse:
    """Times the forwards of a rank's stage modules on every step and reports changes."""

    def __init__(self, modules: Iterable[nn.Module], device: torch.device | str, *, threshold: float = 0.3,
                 confirm: int = 3, history: int = 8) -> None:
        if not threshold > 0:
            raise ValueError(f"pulse threshold must be > 0, got {threshold!r}")
        if not (isinstance(confirm, int) and 1 <= confirm < history):
            raise ValueError(f"pulse confirm must be an integer in [1, {history}), got {confirm!r}")
        self.modules = list(modules)
        self.threshold = threshold
        self.confirm = confirm
        self._clock = clock_for(torch.device(device))
        # per micro-batch forward seconds since the change
        self._history: deque[float] = deque(maxlen=history)
        self._recent: deque[float] = deque(maxlen=confirm)
        self._open: dict[int, Any] = {}
        self._marks: list[tuple[Any, Any]] = []
        self._waiting: list[tuple[Any, Any]] = []  # a device clock's marks of the last judged step
        self._judge = False
        self._skip = 1  # steps not judged from now on (the first carries one-off costs)
        self._trainable = self._trainable_count()
        self._handles: list[RemovableHandle] = []
        for module in self.modules:
            self._handles += [module.register_forward_pre_hook(self._start),
                              module.register_forward_hook(self._end)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def restart(self) -> None:
        """A plan took effect: what the stage runs changed, so its level is learnt again."""
        self._history.clear()
        self._recent.clear()
        self._waiting.clear()
        self._skip = 1
        self._trainable = self._trainable_count()

    def pause(self) -> None:
        """The next step runs beside other work than the last (the sampling interval changed): it is not
        judged, but the level stays. Learning it anew (:meth:`restart`) would swallow a change that came in
        the same few steps: a device recovering as the interval doubled was never reported."""
        self._skip = max(self._skip, 1)

    # ---------------------------------------------------------------- per step
    def begin_step(self, sampled: bool) -> None:
        self._marks.clear()
        self._open.clear()
        self._judge = not sampled

    def end_step(self) -> PulseChange | None:
        """The change this step revealed, if any (after it, the watch starts over)."""
        trainable = self._trainable_count()
        if trainable != self._trainable:
            before, self._trainable = self._trainable, trainable
            self.restart()
            return PulseChange(f"trainable parameters changed from {before} to {trainable}", 1.0)
        value = self._settled_value()
        if self._judge and self._marks and isinstance(self._clock, CudaClock):
            self._waiting = list(self._marks)  # read at the next step's end: a device clock never waits
        if value is None:
            return None
        if self._skip:
            self._skip -= 1
            return None
        self._recent.append(value)
        if len(self._history) >= self.confirm + 1 and len(self._recent) == self.confirm:
            level = max(statistics.median(self._history), 1e-12)
            ratio = statistics.median(self._recent) / level
            # every one of the last steps beyond the threshold, on the same side: a busy core slows some steps
            # by 1.4x and more (ranks sharing cores), a slower device or a longer sequence slows them all
            if min(self._recent) / level > 1 + self.threshold or max(self._recent) / level < 1 / (
                1 + self.threshold
            ):
                self._history.clear()
                self._history.extend(self._recent)  # the new level is the one to compare with from now on
                self._recent.clear()
                return PulseChange(f"forward time per micro-batch changed {ratio:.2f}x", ratio)
        self._history.append(value)
        return None

    def _settled_value(self) -> float | None:
        """Forward seconds per micro-batch of the last judged step whose marks are readable, or None."""
        if isinstance(self._clock, CudaClock):  # events: the previous judged step's, once they have completed
            marks, self._waiting = self._waiting, []
            if marks and not marks[-1][1].query():
                return None
        elif self._judge:
            marks = self._marks
        else:
            return None
        if not marks:
            return None
        return sum(self._clock.seconds(start, end) for start, end in marks) / len(marks)

    # ---------------------------------------------------------------- hooks
    def _start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._judge and torch.is_grad_enabled() and not _is_meta(args):
            self._open[id(module)] = self._clock.mark()

    def _end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        start = self._open.pop(id(module), None)
        if start is not None:
            self._marks.append((start, self._clock.mark()))

    def _trainable_count(self) -> int:
        return sum(1 for module in self.modules for p in module.parameters() if p.requires_grad)


def _is_meta(args: tuple[Any, ...]) -> bool:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.is_meta
