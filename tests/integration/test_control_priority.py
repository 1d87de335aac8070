"""The planner daemon plans below the training ranks' priority."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import torch.distributed as dist

from vpipe.control.channel import ControlPlane
from vpipe.control.planner_link import PlannerLink
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


def test_a_rank_starts_its_daemon_at_its_own_priority_and_the_daemon_lowers_itself_once_loaded(monkeypatch):
    """Started at nice 10, the daemon's imports took seconds on a busy host and its first plan came late: it
    starts at the rank's priority and plans at nice 10."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    plane = ControlPlane(store, 0, 1, lookup_timeout_s=5.0)
    link = PlannerLink(plane, stage_index=0, num_stages=1)
    try:
        link.start("vpipe.planner.online:srp")
        daemon = link.process
        assert daemon is not None
        # still importing
        assert os.getpriority(os.PRIO_PROCESS, daemon.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        deadline = time.monotonic() + 30
        while os.getpriority(os.PRIO_PROCESS, daemon.pid) != PLANNER_NICE:
            assert daemon.poll() is None, f"the daemon exited with code {daemon.returncode}"
            assert time.monotonic() < deadline, "the daemon did not lower itself within 30 s"
            time.sleep(0.05)
    finally:
        link.close(wait_s=0.1)  # never attached: nobody says bye, so it is terminated
        plane.close(linger_ms=0)
