"""Schedules vpipe adds to torch's pipelining: PipeDream's asynchronous 1F1B with weight stashing."""

from vpipe.schedules.pipedream import SchedulePipeDream

__all__ = ["SchedulePipeDream"]
