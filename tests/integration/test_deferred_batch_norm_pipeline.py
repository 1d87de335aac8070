"""``deferred_batch_norm=True`` on a real 2-rank GPipe pipeline: every BatchNorm's running statistics are
those of one process training the whole model on the same batches, one update per step, blocks moved or not.

``tests/workers/norm_worker.py`` trains 8 BatchNorm blocks (momentum 0.1 and None, affine and not) split 6,2
for 8 steps of 4 micro-batches, and the reference in one process. Parameters: the pipeline computes what the
reference computes, op for op (checked to float rounding all the same). Running statistics: the pipeline
merges each micro-batch's mean and variance in float64 where the reference's BatchNorm sums the whole
batch in float32 (a double accumulator on CPU); they differ by float32 rounding, carried through 8 steps of
training, never by an update missing or made per micro-batch (then they would be off by the momentum times
the statistics' spread, 1e-2 and more): rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.processes import run_worker

STEPS = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


def run_norms(tmp_path: Path, scenario: str) -> dict:
    return run_worker(tmp_path, "norm_worker", scenario, 2)


def assert_matches_reference(result: dict) -> None:
    got, want = result["vpipe"], result["reference"]
    assert got.keys() == want.keys()
    norms = [k for k in want if ".bn." in k]
    assert len(norms) == 8 * 3 + 4 * 2  # running mean, var and batches tracked of 8 BatchNorms; 4 are affine
    for name in want:
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(want[name]), **TOL, msg=name)
    for layer in range(8):  # one update per step, not one per micro-batch
        assert got[f"layers.{layer}.bn.num_batches_tracked"] == STEPS
    # the deferred BatchNorms were in force while training, torch's are back after detach
    assert result["classes"] == ["DeferredBatchNorm1d"] and result["classes_after_detach"] == ["BatchNorm1d"]


def moved(log: list[dict]) -> set[int]:
    return {lid for r in log if r.get("event") == "migration_done" for layers in r["moved"] for lid in layers}


def test_running_statistics_equal_one_process_on_the_whole_batches(tmp_path):
    result = run_norms(tmp_path, "still")
    assert result["placement"] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert_matches_reference(result)


@pytest.mark.parametrize("scenario", ["moves", "factory"])
def test_moved_blocks_keep_deferring_and_their_statistics_equal_one_process(tmp_path, scenario):
    """Blocks 4 and 5 move to stage 1 and block 4 back (6,2 -> 4,4 -> 5,3), cloned from a deferred block of
    their kind or built by a layer factory that makes torch's BatchNorm (deferred on arrival)."""
    result = run_norms(tmp_path, scenario)
    assert result["placement"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert moved(result["log"]) == {4, 5}
    assert_matches_reference(result)



def test_under_pipedream_each_step_commits_once_as_the_schedule_without_vpipe_would(tmp_path):
    """vpipe's PipeDream schedule (no flush) against the same schedule without vpipe, side by side, its
    BatchNorms deferred by hand and committed after each ``step()``: the same statistics, bit for bit."""
    result = run_norms(tmp_path, "pipedream_still")
    assert result["vpipe"] == result["reference"]
    assert [result["vpipe"][f"layers.{i}.bn.num_batches_tracked"] for i in range(8)] == [STEPS] * 8


def test_blocks_streamed_mid_step_under_pipedream_take_one_update_per_step(tmp_path):
    """A streamed move switches at a micro-batch inside a step: the block's accumulators go with
    its state at the hand-over, the sender's part makes its own update (an earlier
    mini-batch's), the receiver's joins this step's. (A moved layer runs on another stage's
    weight versions, so there is no statistic to compare.)"""
    result = run_norms(tmp_path, "pipedream_moves")
    assert result["placement"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert [result["vpipe"][f"layers.{i}.bn.num_batches_tracked"] for i in range(8)] == [STEPS] * 8
    for name, value in result["vpipe"].items():
        assert torch.isfinite(torch.tensor(value, dtype=torch.float64)).all(), name
    assert result["classes"] == ["DeferredBatchNorm1d"] and result["classes_after_detach"] == ["BatchNorm1d"]


def test_attached_after_a_step_under_pipedream_the_stashed_versions_pin_nothing(tmp_path):
    """Stage 0 holds stashed weight versions when vpipe attaches mid-stream: dicts of tensor
    copies keyed by its parameter names, which the scan for a trainer's weight averages took for
    an EMA and pinned every block. They are the schedule's own (its engine names them): the
    blocks move as when attached at the start, and a plan's switch counts the micro-batches the
    stream ran before attach (it asked for one already run)."""
    result = run_norms(tmp_path, "pipedream_moves_late")
    assert result["stashed_at_attach"][0] >= 1
    assert not [r for r in result["log"] if r.get("event") == "moves_off"]
    # a switch before attach's first step: an error
    assert result["placement"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    # the step before attach ran torch's BatchNorm (4 micro-batches and shape inference's forward), then one
    # update per step, moved blocks included
    assert [result["vpipe"][f"layers.{i}.bn.num_batches_tracked"]
            for i in range(8)] == [4 + 1 + STEPS - 1] * 8


def test_torchs_own_batchnorm_streamed_mid_step_under_pipedream_loads_without_failing_a_backward(tmp_path):
    """Without deferral: the hand-over loads the sender's running statistics into a copy whose backwards are
    still to come, and they saved its old ones; copying into those in place failed them ("modified by an
    inplace operation", found while testing deferral). The buffers are replaced instead, and training goes on.

    What is compared: the updates each block's statistics took, and that the weights stay finite. Not the
    statistics' values: torch's shape inference runs the second stage's forward once on ``torch.empty``
    inputs at the first step, in both copies, and its BatchNorms average whatever that memory held (NaN,
    1e23 or small values, run to run, vpipe attached or not: CI saw each copy overflow while the other did
    not). A streamed block's statistics lose the updates its new stage's forwards made before the hand-over
    loaded the sender's (docs/stage-shapes.md): one or two per hand-over here, where
    ``deferred_batch_norm=True`` merges them
    (:func:`test_blocks_streamed_mid_step_under_pipedream_take_one_update_per_step`)."""
    result = run_norms(tmp_path, "pipedream_moves_plain")
    assert result["placement"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    got, want = result["vpipe"], result["reference"]
    assert got.keys() == want.keys()
    counts = {k: (got[k], want[k]) for k in want if k.endswith("num_batches_tracked")}
    assert len(counts) == 8
    for layer in range(8):  # 8 steps of 4 micro-batches and torch's one inference forward on each BatchNorm
        vp, plain = counts[f"layers.{layer}.bn.num_batches_tracked"]
        assert plain == STEPS * 4 + 1
        assert plain - {4: 3, 5: 2}.get(layer, 0) <= vp <= plain, layer  # 4 moved twice, 5 once
    weights = {k: v for k, v in got.items() if ".bn." not in k}
    assert all(torch.isfinite(torch.tensor(v)).all() for v in weights.values())
    assert result["classes"] == ["BatchNorm1d"]
