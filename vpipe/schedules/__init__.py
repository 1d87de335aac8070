"""Schedules vpipe adds to torch's pipelining: PipeDream's asynchronous 1F1B with
weight stashing, and PipeDream-2BW's double-buffered weights with gradient
accumulation, and WPipe's double-grouped weight updates."""

from vpipe.schedules.pipedream import SchedulePipeDream
from vpipe.schedules.pipedream_2bw import SchedulePipeDream2BW
from vpipe.schedules.wpipe import ScheduleWPipe

__all__ = ["SchedulePipeDream", "SchedulePipeDream2BW", "ScheduleWPipe"]
