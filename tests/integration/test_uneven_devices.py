"""A rank slower than the others: vpipe sees it, moves blocks off it, and trains exactly as without vpipe."""

from __future__ import annotations

from test_block_moves import assert_trains_like_plain, moved_layers

from support.processes import run_worker


def _events(log: list[dict], event: str) -> list[dict]:
    return [r for r in log if r.get("event") == event]


def test_blocks_leave_a_slower_rank_and_training_is_bitwise_the_same(tmp_path):
    result = run_worker(tmp_path, "speed_worker", "slow", 2)
    counts = [len(s) for s in result["placement"]]
    assert counts[1] < 4, f"rank 1 is twice as slow; it still holds {counts[1]} of 8 blocks"
    assert moved_layers(result["log"])
    speeds = _events(result["log"], "stage_speed")
    assert speeds and speeds[0]["msg"].startswith("stage 1 runs its blocks") and "slower than stage 0" in \
        speeds[0]["msg"]
    plans = _events(result["log"], "plan")
    assert plans and plans[0]["stage_speeds"][0] == 1.0 and plans[0]["stage_speeds"][1] > 1.25
    # samples at steps 1 (start-up), 3, 5, 7: three that agree name the slow stage, and its plan goes at once
    # (applied about step 11; 15 leaves room for a busy machine's late samples)
    first = min(r["step"] for r in _events(result["log"], "plan_applied"))
    assert first <= 15, f"the first move took effect at step {first}"
    assert_trains_like_plain(result)


def test_an_even_pipeline_on_even_devices_stays_put(tmp_path):
    result = run_worker(tmp_path, "speed_worker", "even", 2)
    assert result["placement"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not moved_layers(result["log"]) and not _events(result["log"], "plan")
    assert_trains_like_plain(result)


def _placements(log: list[dict]) -> list[list[list[int]]]:
    """The placements the run went through, in order (the start, then each committed move's)."""
    seen = [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    for r in sorted(_events(log, "plan_applied"), key=lambda r: (r["epoch"], r["stage"])):
        if r["stage"] == 0:
            layers0 = r["layers"]
            placement = [layers0, [lid for lid in range(8) if lid not in layers0]]
            if placement != seen[-1]:
                seen.append(placement)
    return seen


def test_over_200_steady_steps_an_even_pipeline_stays_put_and_a_slow_rank_is_left_once(tmp_path):
    """Nothing changes after the start: on even devices no block ever moves; with rank 1 twice as slow blocks
    leave it, and no placement is left and then taken again (no back and forth)."""
    (tmp_path / "even").mkdir()
    (tmp_path / "slow").mkdir()
    even = run_worker(tmp_path / "even", "speed_worker", "even_200", 2)
    assert even["placement"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and not moved_layers(even["log"])
    slow = run_worker(tmp_path / "slow", "speed_worker", "slow_200", 2)
    placements = _placements(slow["log"])
    assert len(placements) >= 2 and len(slow["placement"][1]) < 4
    back = [p for i, p in enumerate(placements) if p in placements[:i]]
    assert not back, f"the run went back and forth: {placements}"
    assert_trains_like_plain(slow)
