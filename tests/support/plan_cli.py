"""Test helpers: plan_cli."""

from __future__ import annotations

import json
from pathlib import Path

from vpipe.cli import main

MODELS = str(Path(__file__).resolve().parent / "plan_models.py")  # factories, by file (any working directory)


def plan_command(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *args])
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def json_plan(capsys, *args: str) -> dict:
    code, out, err = plan_command(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)
