"""Training monitors: per-layer times, memory and copy-link figures of each stage.

``records`` (the wire-level stats) imports no torch, so the planner daemon can read
records cheaply; the monitor itself is loaded on first use.
"""

from __future__ import annotations

from typing import Any

from vpipe.monitors.records import GPU_ONLY_FIELDS, LayerRecord, RecordError, StageRecord
from vpipe.monitors.source import SavedTensorSource, SavedTensorStats

__all__ = ["StageMonitor", "Sample", "layers_of", "KeepAllSource", "LayerRecord", "StageRecord",
           "RecordError",
           "SavedTensorSource", "SavedTensorStats", "GPU_ONLY_FIELDS"]


def __getattr__(name: str) -> Any:
    if name in ("StageMonitor", "Sample", "layers_of"):
        from vpipe.monitors import stage

        return getattr(stage, name)
    if name == "KeepAllSource":
        from vpipe.monitors.keep_all import KeepAllSource

        return KeepAllSource
    raise AttributeError(f"module 'vpipe.monitors' has no attribute {name!r}")
