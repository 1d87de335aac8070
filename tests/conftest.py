"""Shared helpers: tests start real processes through the real CLI and compare their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (CI included): a property that fails, fails for
# everyone, not by the luck of the draw. VPIPE_HYPOTHESIS_PROFILE=default explores new examples.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.load_profile(os.environ.get("VPIPE_HYPOTHESIS_PROFILE", "repeatable"))

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.update(extra)
    return env


def run_vpipe(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m vpipe_lab ARGS`` (the `vpipe` command); return the finished process, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "vpipe_lab", *args],
        cwd=ROOT, env=env or child_env(), capture_output=True, text=True, timeout=timeout,
    )


def load_run_params(out_dir: Path, stages: int) -> dict[str, torch.Tensor]:
    """All stages' saved parameters merged into one state dict (names are 'layer_id.param')."""
    merged: dict[str, torch.Tensor] = {}
    for rank in range(stages):
        state = torch.load(out_dir / f"rank{rank}.pt", weights_only=True)
        merged.update(state["params"])
    return merged


def load_run_optimizer(out_dir: Path, stages: int) -> dict[str, dict[str, torch.Tensor]]:
    """All stages' optimizer state, keyed by parameter name."""
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for rank in range(stages):
        merged.update(torch.load(out_dir / f"rank{rank}.pt", weights_only=True)["optimizer"])
    return merged


def assert_optimizer_equal(actual: dict[str, dict[str, torch.Tensor]],
                           expected: dict[str, dict[str, torch.Tensor]]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        assert sorted(actual[name]) == sorted(want), name
        for key, value in want.items():
            assert torch.equal(actual[name][key], value), f"optimizer state {name}.{key} differs"


def assert_params_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 0.0) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        if rtol == 0.0:
            assert torch.equal(got, want), f"{name}: max abs diff {(got - want).abs().max().item():.3e}"
        else:
            rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            assert rel <= rtol, f"{name}: max relative difference {rel:.3e} > {rtol:.0e}"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


def run_worker(tmp_path: Path, worker: str, scenario: str, ranks: int) -> dict:
    """Run ``tests/WORKER.py SCENARIO OUT`` on ``ranks`` real ranks; its JSON result plus the vpipe log records."""
    from vpipe.log import read_log
    from vpipe_lab.runtime.launch import spawn

    out, log_file = tmp_path / f"{scenario}.json", tmp_path / f"{scenario}.log"
    code = spawn([sys.executable, str(ROOT / "tests" / f"{worker}.py"), scenario, str(out)], ranks,
                 extra_env={"PYTHONPATH": str(ROOT), "VPIPE_LOG_FILE": str(log_file)}, timeout_s=240)
    assert code == 0
    result = json.loads(out.read_text())
    result["log"] = read_log(log_file) if log_file.exists() else []
    return result
