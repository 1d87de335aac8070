"""Timestamps for per-layer timing: ``perf_counter`` on CPU, CUDA events on a GPU.

A CUDA event is recorded on the current stream and read only once the sampled iteration
is over (one wait on its last event), so timing never synchronizes the device per layer.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["Clock", "clock_for"]


class Clock:
    """Host clock: a mark is a ``perf_counter`` reading."""

    def mark(self) -> Any:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return max(0.0, end - start)

    def settle(self, last: Any) -> None:
        """Make every mark up to ``last`` readable (nothing to wait for on the host)."""


class CudaClock(Clock):
    """Device clock: a mark is a timing event recorded on the current CUDA stream."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return max(0.0, start.elapsed_time(end) / 1000.0)

    def settle(self, last: Any) -> None:
        if last is not None:
            last.synchronize()


def clock_for(device: torch.device) -> Clock:
    return CudaClock() if torch.device(device).type == "cuda" else Clock()
