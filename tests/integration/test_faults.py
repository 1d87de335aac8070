"""Faults injected on purpose, each with its exact outcome.

Covered elsewhere (not repeated here):
- a rank killed from outside by SIGKILL: ``test_launch.py::test_dead_rank_ends_every_rank_with_its_name``;
- the planner daemon killed, training finishing on the current plan and a new daemon re-attaching:
  ``test_control_run.py::test_killed_planner_is_reported_training_finishes_and_a_restarted_one_resumes`` (and
  in-process
  ``test_control_agent.py::test_lost_planner_is_reported_and_a_new_one_attaches_and_gets_the_backlog``);
- a neighbour that never answers during a migration (rollback on both sides, parameters
  equal to the reference) or dies in it: ``test_migration_faults.py``.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from support.processes import WORKERS, child_env, run_ranks, run_vpipe
from support.results import assert_params_equal, load_run_params
from vpipe import faults
from vpipe.checkpoint import find_latest, load_checkpoint
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import reference_flush

SMALL = ["--blocks", "4", "--d-model", "32", "--n-heads", "2", "--seq-len", "16", "--micro-batch-size", "2",
         "--dropout", "0", "--no-progress"]


def rank_lines(stderr: str, rank: int) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(f"vpipe [rank {rank}]:")]


def test_a_stage_killed_mid_step_stops_every_rank_and_the_last_checkpoint_resumes(tmp_path):
    ck = tmp_path / "ck"
    env = child_env(VPIPE_FAULTS="kill@5:2", VPIPE_HEARTBEAT_TIMEOUT="5")
    started = time.monotonic()
    proc = run_vpipe("train", *SMALL, "--stages", "4", "--steps", "50", "--checkpoint-dir", str(ck),
                     "--checkpoint-every", "2", env=env, timeout=180)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert elapsed < 150, f"the run took {elapsed:.0f} s to stop"
    assert "rank 2 exited first with code -9" in proc.stderr, proc.stderr[-3000:]
    for rank in (0, 1, 3):
        lines = rank_lines(proc.stderr, rank)
        assert lines and "rank 2 stopped answering (dead or hung)" in lines[-1], proc.stderr[-3000:]
    # the checkpoints before the kill are sealed and whole; nothing of step 5 or later was sealed (the lock
    # file rank 0 held on the directory stays, as test_checkpoint.py shows; its flock died with the run)
    assert sorted(p.name for p in ck.iterdir()) == [".vpipe-lock", "step-00000002", "step-00000004"]
    last = load_checkpoint(find_latest(ck))  # verifies every shard's sha256
    assert last.step == 4 and last.num_stages == 4
    # and it is good: resumed on two stages it continues to the reference's parameters
    resumed = run_vpipe("train", *SMALL, "--stages", "2", "--steps", "6", "--resume", str(ck),
                        "--out-dir", str(tmp_path / "out"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    cfg = RunConfig(stages=2, steps=6, blocks=4, d_model=32, n_heads=2, seq_len=16, micro_batch_size=2,
                    dropout=0.0)
    assert_params_equal(load_run_params(tmp_path / "out", 2), reference_flush(cfg)[0])


def test_a_budget_that_cannot_hold_one_layer_names_the_layer_and_sizes():
    # 600 KiB holds stage 0's weights, gradients and Adam state (533 KiB) but not layer 1's activations
    proc = run_vpipe("train", *SMALL, "--stages", "2", "--steps", "3", "--vpipe", "--no-planning",
                     "--memory-budget", "600KiB", env=child_env(VPIPE_HEARTBEAT_TIMEOUT="5"), timeout=180)
    assert proc.returncode == 1
    message = ("MemoryBudgetError: layer 1 needs 69.5 KiB of saved activations even fully recomputed "
               "> budget 67.0 KiB")
    assert (
        rank_lines(proc.stderr, 0)[-1] == f"vpipe [rank 0]: rank 0 failed: {message}: a recompute "
        "materialises them all at once; raise the stage's budget, use smaller micro-batches, "
        "or split the layer"
    )
    assert f"stopping because rank 0 failed: {message}" in rank_lines(proc.stderr, 1)[-1]
    assert "rank 0 exited first with code 1" in proc.stderr


def test_a_budget_below_the_weights_is_refused_at_attach():
    proc = run_vpipe("train", *SMALL, "--stages", "2", "--steps", "3", "--vpipe", "--no-planning",
                     "--memory-budget", "300KiB", env=child_env(VPIPE_HEARTBEAT_TIMEOUT="5"), timeout=180)
    assert proc.returncode == 1
    assert rank_lines(proc.stderr, 0)[-1] == (
        "vpipe [rank 0]: rank 0 failed: MemoryBudgetError: stage 0: parameters, gradients, "
        "optimizer state and stashed weight versions take 545792 bytes, the memory budget is 307200 bytes")


def attach_outcome(tmp_path, mode: str) -> dict:
    out = tmp_path / f"{mode}.json"
    run_ranks([str(WORKERS / "fault_worker.py"), mode, str(out)], 1, tmp_path / f"{mode}.txt")
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode, error", [
    ("pool", r"HostPoolFullError: layer 0, micro-batch 0: host pool full: a swap of 16\.0 KiB does not fit; "
             r"0 B of the pool's maximum 4\.0 KiB are in use"),
    ("budget", r"MemoryBudgetError: layer 0 needs 24\.0 KiB of saved activations even fully recomputed "
               r"> budget 1\.0 KiB"),
], ids=["host-pool", "budget"])
def test_an_impossible_memory_limit_fails_the_step_before_any_damage(tmp_path, mode, error):
    got = attach_outcome(tmp_path, mode)
    # vpipe's error, not torch's "[Stage 0] failed to run forward"
    assert re.match(error, got["error"]), got["error"]
    assert got["params_unchanged"] and got["optimizer_state_empty"]
    assert got["trains_afterwards"]  # detached, the same trainer trains normally


def test_a_pipelining_api_that_differs_is_refused_at_attach(tmp_path):
    got = attach_outcome(tmp_path, "api")
    assert got["error"].startswith("RuntimeError: vpipe cannot attach to ScheduleGPipe with torch ")
    assert "its pipelining API lacks _stage_backward_initialized" in got["error"]
    assert not got["step_wrapped"] and got["params_unchanged"]  # nothing was installed


def test_fault_specs_parse_and_bad_ones_are_named():
    assert faults.parse("kill@5:2, migration_silent@1") == {"kill@5": {2}, "migration_silent": {1}}
    for bad in ("kill@5", "kill@x:1", "explode@1", "migration_die@"):
        with pytest.raises(ValueError, match=re.escape(f"VPIPE_FAULTS: bad entry {bad!r}")):
            faults.parse(bad)
