"""Real multi-process pipelines (gloo): the manager must not change one bit of training.

Each test launches ``tensor_manager_worker`` through vpipe's launcher; every rank trains
without a manager and then under each scenario, and reports whether all gradients and
final parameters are bitwise equal, with the manager's statistics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.processes import ROOT, child_env

RANKS = 2


def _launch(tmp_path, schedule: str, scenarios: str, model: str = "transformer",
            blocks: int = 4) -> list[dict]:
    path = os.pathsep.join([str(ROOT / "tests" / "workers"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "tensor_manager_worker", "--schedule", schedule, "--model", model,
         "--blocks", str(blocks), "--scenarios", scenarios, "--ranks", str(RANKS), "--out", str(tmp_path)],
        cwd=ROOT, env=child_env(PYTHONPATH=path), capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [record["rank"] for record in ranks] == list(range(RANKS))
    for record in ranks:  # every rank ran every scenario asked for (an empty report must not pass for exact)
        assert list(record["scenarios"]) == scenarios.split(","), (record["rank"], list(record["scenarios"]))
    return ranks


def _assert_exact(ranks: list[dict]) -> None:
    for record in ranks:
        assert record["scenarios"]
        for scenario, result in record["scenarios"].items():
            assert result["diff"] is None, f"rank {record['rank']}, scenario {scenario}: {result['diff']}"


def _managers(ranks: list[dict], scenario: str) -> list[dict]:
    """Every stage's manager statistics under ``scenario``: each rank has its stages' managers, and together
    they manage every layer of the model exactly once."""
    per_rank = [record["scenarios"][scenario]["stats"] for record in ranks]
    assert per_rank[0] and all(len(stats) == len(per_rank[0]) for stats in per_rank), [len(s)
                                                                                       for s in per_rank]
    layers = sorted(lid for stats in per_rank for s in stats for lid in s["layers"])
    assert layers == list(range(len(layers))) and all(s["layers"] for stats in per_rank
                                                      for s in stats), layers
    return [s for stats in per_rank for s in stats]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flush_schedules_exact_and_under_budget(schedule, tmp_path):
    ranks = _launch(tmp_path, schedule, "D,S,R,mix,switch,budget", blocks=6)
    _assert_exact(ranks)
    assert all(len(_managers(ranks, scenario)) == RANKS
               for scenario in ("D", "S", "R", "mix", "switch", "budget"))
    for stats in _managers(ranks, "budget"):
        assert stats["budget"] is not None and 0 < stats["peak"] <= stats["budget"], stats
    all_kept = {tuple(s["layers"]): s["peak"] for s in _managers(ranks, "D")}
    for stats in _managers(ranks, "budget"):
        assert stats["peak"] < all_kept[tuple(stats["layers"])]
    assert any(s["escalations"] for s in _managers(ranks, "budget"))
    assert all(s["d2h_bytes"] > 0 and s["live"] == 0 and s["host_used"] == 0 for s in _managers(ranks, "S"))
    assert all(s["recompute_s"] > 0 for s in _managers(ranks, "R"))


@pytest.mark.parametrize("schedule", ["zb", "zbv", "dualpipev"])
def test_zero_bubble_two_stages_per_rank_exact_fetched_once_recomputed_once(schedule, tmp_path):
    """Split backwards (input pass, weight pass later): every layer
    swapped, recomputed, or a mix; a budget."""
    ranks = _launch(tmp_path, schedule, "D,S,R,mix,budget")
    _assert_exact(ranks)
    for stats in _managers(ranks, "budget"):  # 40% of the rank's largest all-kept peak, weight passes lagging
        assert stats["budget"] is not None and stats["peak"] <= stats["budget"], stats
        assert stats["host_used"] == 0 and stats["live"] == 0 and stats["resident"] == 0, stats
    assert any(s["escalations"] for s in _managers(ranks, "budget"))
    swapped = _managers(ranks, "S")
    assert len(swapped) == 2 * RANKS  # one manager per stage
    for stats in swapped + _managers(ranks, "mix"):
        # brought back once, for both passes, and nothing left behind; except the embedding's token ids:
        # one storage for every micro-batch of the step (chunks of one batch), brought back for each
        # micro-batch's backward, which is not about split passes
        for lid, (d2h, h2d) in stats["layer_copies"].items():
            assert h2d == d2h or lid == "0", (lid, stats)
        assert stats["h2d_bytes"] - stats["d2h_bytes"] == stats["refetched"], stats
        assert stats["refetched"] == 0 or stats["layers"] == [0, 1], stats
        assert stats["host_used"] == 0 and stats["live"] == 0 and stats["resident"] == 0, stats
    # the first stage runs its whole backward in the weight call (one pass); the others unpack in both,
    # and their weight passes found on the device all they needed (DualPipeV also runs full backwards)
    assert all(s["multi_phase"] > 0 for s in swapped if s["layers"] != [0, 1])
    assert all(set(s["h2d_by_phase"]) == {"full"} for s in swapped if s["layers"] == [0, 1])
    assert all("input" in s["h2d_by_phase"] and "weight" not in s["h2d_by_phase"]
               for s in swapped if s["layers"] != [0, 1])
    for stats in _managers(ranks, "R") + _managers(ranks, "mix"):
        # one recompute per layer call, serving both passes
        assert stats["recomputes"] == stats["recompute_calls"] and stats["repeat_recomputes"] == 0, stats
    assert all(s["recompute_calls"] > 0 for s in _managers(ranks, "R"))


def test_pipedream_weight_stashing_exact(tmp_path):
    ranks = _launch(tmp_path, "pipedream", "S,R,mix")
    _assert_exact(ranks)
    assert len(_managers(ranks, "S")) == RANKS
    for stats in _managers(ranks, "S"):
        assert stats["weights_skipped"] > 0 and stats["d2h_bytes"] > 0


def test_cnn_under_1f1b_exact(tmp_path):
    _assert_exact(_launch(tmp_path, "1f1b", "S,R,mix", model="cnn"))
