"""The planner daemon runs below the training ranks' priority from its start."""

from __future__ import annotations

import os
import subprocess
import sys

from vpipe.control.priority import PLANNER_NICE, to_background


def test_a_spawned_process_is_lowered_once_and_stays_at_the_planner_nice():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert to_background(child.pid)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == PLANNER_NICE
        assert to_background(child.pid)  # a daemon lowering itself again does not go lower still
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == PLANNER_NICE
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_is_reported_not_raised():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert to_background(child.pid) is False
