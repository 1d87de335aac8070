"""Test helpers: control_runs."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from support.processes import ROOT, child_env
from vpipe.log import read_log

MARKER = "support.control_planners:record_and_mark"


def planner_env(out: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", str(ROOT))])
    return child_env(PYTHONPATH=path, VPIPE_TEST_PLANNER_OUT=str(out), **extra)


def received(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def decisions(log_file: Path, event: str) -> list[dict]:
    return [r for r in read_log(log_file) if r.get("event") == event] if log_file.exists() else []


def wait_while_running(condition, timeout_s: float, what: str, launcher: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if launcher.poll() is not None:
            pytest.fail(f"the run ended (code {launcher.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)
