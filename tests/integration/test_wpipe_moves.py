"""Blocks moved under WPipe (``vpipe.ScheduleWPipe``) on two real gloo ranks, two stages each: G0's streamed
from stage to stage (switching at a period's start with both weight versions and the optimizer state), G1's
at a step boundary, both ways; the run ends bitwise as the schedule alone, a plan across the groups' boundary
is refused in one line, and the engine names G0's stashed copies as its own
(tests/workers/wpipe_move_worker.py)."""

from __future__ import annotations

import json

import pytest
import torch

from support.processes import run_saved_runs, run_vpipe
from support.results import assert_params_equal, load_run_params
from vpipe_lab.runtime import reference
from vpipe_lab.runtime.config import RunConfig

RANKS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """One launch, three runs (see tests/workers/wpipe_move_worker.py): each rank's results."""
    return run_saved_runs(tmp_path_factory.mktemp("wpipe_moves"), "wpipe_move_worker", RANKS)


def _unequal(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if not torch.equal(v, ref[k])]


def test_blocks_moved_both_ways_in_both_groups_end_bitwise_as_the_schedule_alone(runs):
    """Every G0 stage runs a period on one version and every G1 stage updates at the step's end, so where a
    block trained does not change it: layer 2 moves to stage 0 (G0, streamed, switching at step 2) and layer 5
    to stage 3 (G1, at the boundary where the round starts, a step before), both back at step 5 (the last)."""
    moved = [runs[r]["moved"]["layers"] for r in range(RANKS)]
    assert [moved[0][s] for s in (0, 1, 2, 4, 5)] == [[[0, 1], [4, 5]], [[0, 1], [4]], [[0, 1, 2], [4]],
                                                      [[0, 1, 2], [4, 5]], [[0, 1], [4, 5]]]
    assert [moved[1][s] for s in (0, 1, 2, 4, 5)] == [[[2, 3], [6, 7]], [[2, 3], [5, 6, 7]], [[3], [5, 6, 7]],
                                                      [[3], [6, 7]], [[2, 3], [6, 7]]]
    for rank in range(RANKS):
        run, plain = runs[rank]["moved"], runs[rank]["plain"]
        assert run["move_refusal"] is None
        assert sorted(run["state"]) == sorted(plain["state"]) and _unequal(run["state"], plain["state"]) == []
        assert run["losses"] == plain["losses"] and run["peak_versions"] == [2, 1]
    assert all(len(step) == 3 for step in runs[RANKS - 1]["moved"]["losses"])


def test_a_plan_across_the_boundary_between_the_groups_is_refused_in_one_line(runs):
    for rank in range(RANKS):
        assert runs[rank]["moved"]["crossing"] == ("under ScheduleWPipe layers [4] would cross the boundary "
                                                   "between G0 and G1 (stages 1 and 2), which stays fixed")


def test_the_engine_names_g0s_stashed_copies_by_parameter_as_under_2bw(runs):
    """At the end of every step G0 keeps the version its period in flight runs on (and the newest once one
    is stashed): the copies' names are the G0 stage's parameters, the moved block's with it."""
    copies = [runs[r]["moved"]["copies"] for r in range(RANKS)]
    names = {lid: [f"{lid}.0.bias", f"{lid}.0.weight"] for lid in range(4)}
    assert copies[0][0] == names[0] + names[1]
    assert copies[0][2] == names[0] + names[1] + names[2]  # layer 2 arrived on stage 0 at step 2
    assert copies[1][2] == names[3]
    assert copies[1][5] == names[2] + names[3]


def test_the_planner_running_under_wpipe_with_moves_allowed_changes_nothing(runs):
    for rank in range(RANKS):
        run, plain = runs[rank]["planned"], runs[rank]["plain"]
        assert run["move_refusal"] is None
        assert _unequal(run["state"], plain["state"]) == [] and run["losses"] == plain["losses"]


def test_the_labs_wpipe_schedule_with_forced_moves_trains_as_its_single_process_reference(tmp_path):
    """``vpipe train --schedule wpipe --vpipe --moves``: a block of each group moves at step 2 (G0's stage 1
    to stage 0, G1's stage 2 to stage 3) and back at step 5; the weights are bitwise the reference's."""
    args = ["--stages", "2", "--schedule", "wpipe", "--steps", "6", "--blocks", "6", "--d-model", "16",
            "--n-heads", "2", "--seq-len", "8", "--dropout", "0", "--micro-batches", "2",
            "--micro-batch-size", "2"]
    proc = run_vpipe("train", *args, "--vpipe", "--no-planning", "--moves", "2:3,1,1,3;5:2,2,2,2",
                     "--out-dir", str(tmp_path), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = RunConfig(stages=2, schedule="wpipe", steps=6, blocks=6, d_model=16, n_heads=2, seq_len=8,
                    dropout=0.0, micro_batches=2, micro_batch_size=2)
    want, want_losses = reference.reference_wpipe(cfg)
    assert_params_equal(load_run_params(tmp_path, 2), want)  # bitwise
    assert json.loads((tmp_path / "rank1.json").read_text())["losses"] == want_losses
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["stage_layer_ids"] == [[0, 1], [4, 5]]  # back where they started
