"""Engines: an engine vpipe does not ship runs under it after one adapter and one ``register_engine`` line."""

from __future__ import annotations

import json

import pytest

from support.processes import WORKERS, child_env, run_ranks
from vpipe.log import read_log


def _run(tmp_path, scenario: str) -> tuple[dict, list[dict]]:
    out = tmp_path / f"{scenario}.json"
    run_ranks([str(WORKERS / "engine_worker.py"), scenario, str(out)], 2, tmp_path / f"{scenario}.txt",
              child_env())
    return json.loads(out.read_text()), read_log(out.with_suffix(".log"))


@pytest.mark.parametrize("scenario", ["recompute", "planned"])
def test_a_registered_engine_of_the_trainers_own_trains_as_without_vpipe(tmp_path, scenario):
    result, log = _run(tmp_path, scenario)
    assert result["kind"] == "other" and result["move_refusal"] is None
    assert {r["schedule"] for r in log if r.get("event") == "attached"} == {"LoopTrainer"}
    if scenario == "recompute":  # recomputing changes only where activations live: bitwise the same losses
        assert result["vpipe"] == result["plain"]
        return
    moved = [r for r in log if r.get("event") == "migration_done" and r["moved"]]
    assert moved and result["layers"] != [6, 7], "the 6,2 partition should have been rebalanced"
    for got, want in zip(result["vpipe"], result["plain"], strict=True):
        for a, b in zip(got, want, strict=True):
            assert abs(a - b) <= 1e-6 * abs(b)
