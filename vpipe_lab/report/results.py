"""Reading the benchmark results: every ``NAME.json`` of a results directory, by name.

``vpipe bench --json DIR`` writes them; ``benchmarks/gpu_suite.sh``'s files, copied from a
GPU machine into ``DIR/gpu``, come in as ``gpu_NAME``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["Results", "load_results"]

Results = dict[str, dict[str, Any]]


def load_results(directory: Path) -> Results:
    """Every ``NAME.json`` in ``directory`` (``bench.json``, the run's status, under ``"bench"``)."""
    if not directory.is_dir():
        raise ValueError(f"no results directory {directory}; run `vpipe bench --json {directory}` first")
    results = {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}
    gpu = directory / "gpu"  # benchmarks/gpu_suite.sh's files, copied from a GPU machine
    results.update({f"gpu_{p.stem}": json.loads(p.read_text()) for p in sorted(gpu.glob("*.json"))})
    return results
