"""The planner daemon plans below the training ranks' priority."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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


def test_a_daemon_lowers_itself_once_its_imports_are_done():
    """Started at the ranks' priority (as a rank starts it), the daemon plans at nice 10."""
    daemon = subprocess.Popen([sys.executable, "-m", "vpipe.control.daemon", "--connect", "tcp://127.0.0.1:9",
                               "--planner", "vpipe.planner.online:srp", "--idle-timeout", "30"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while os.getpriority(os.PRIO_PROCESS, daemon.pid) != PLANNER_NICE:
            assert daemon.poll() is None, f"the daemon exited with code {daemon.returncode}"
            assert time.monotonic() < deadline, "the daemon did not lower itself within 30 s"
            time.sleep(0.05)
    finally:
        daemon.kill()
        daemon.wait()
