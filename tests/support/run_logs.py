"""Run logs written for a test: what `vpipe plot` and `vpipe logs` read, without training a run."""

from __future__ import annotations

import json
from pathlib import Path


def plotted_log(path: Path, steps: int) -> Path:
    """A run log at ``path`` that `vpipe plot` draws: stage 0 attached with layers 0 and 1, then ``steps``
    steps of the last stage (0.5 s each, 2 micro-batches)."""
    records = [{"t": 1.0, "rank": 0, "logger": "vpipe.decisions", "level": "INFO", "event": "attached",
                "stage": 0,
                "layers": [0, 1], "msg": "attached"}]
    records += [{"t": 2.0 + i, "rank": 1, "logger": "vpipe.steps", "level": "INFO", "step": i, "step_s": 0.5,
                 "stage": 1, "micro_batches": 2, "layers": 2, "msg": f"step {i}"} for i in range(steps)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
