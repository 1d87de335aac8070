"""The planner daemon plans in the background: it must never take a core from a training rank.

It plans at a lower priority (nice 10). It lowers itself once its imports are done and its
planner is loaded, whoever started it: start-up is about half a second of CPU, once, and at
nice 10 on a host whose cores the ranks keep busy it took 8 s of wall time, so the first plan
came late (runs whose moves the planner decides in their first tens of steps trained without
them).
"""

from __future__ import annotations

import logging
import os

__all__ = ["PLANNER_NICE", "to_background"]

log = logging.getLogger(__name__)

PLANNER_NICE = 10


def to_background(pid: int = 0) -> bool:
    """Give process ``pid`` (0: this one) at least nice :data:`PLANNER_NICE`; False where the platform or a
    sandbox does not allow it (it then runs at the priority it has)."""
    try:
        now = os.getpriority(os.PRIO_PROCESS, pid)
        if now < PLANNER_NICE:
            os.setpriority(os.PRIO_PROCESS, pid, PLANNER_NICE)
        return True
    except (AttributeError, OSError) as e:  # no such call (Windows), or not allowed
        log.debug("could not lower the planner daemon's priority: %s", e)
        return False
