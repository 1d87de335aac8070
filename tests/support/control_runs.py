"""Test helpers: control_runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

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
