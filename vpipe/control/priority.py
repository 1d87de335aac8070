"""The planner daemon plans in the background: it must never take a core from a training rank.

It runs at a lower priority (nice 10) from the moment it starts: the rank that spawns it
lowers it right away, so its start-up (imports of about half a second of CPU) already
yields to the ranks; a daemon started by hand lowers itself.
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
