"""PipeDream-2BW (``vpipe.SchedulePipeDream2BW``) on two real gloo ranks, against its update rule written
out by hand in one process (support/twobw.py): every stage's weights bit for bit, for SGD and Adam; the
weight versions a stage holds (the WPipe paper's Table 1: two); vpipe under it changing nothing, blocks
streamed between stages included; and the lab's ``--schedule pipedream2bw``."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from support.processes import run_saved_runs, run_vpipe
from support.results import assert_params_equal, load_run_params
from support.twobw import FLUSH_AFTER, MICRO_BATCHES, PERIODS, reference_2bw
from vpipe.schedules.pipedream_2bw import period_version
from vpipe_lab.runtime import reference
from vpipe_lab.runtime.config import RunConfig

RANKS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """One launch, four runs (see tests/workers/twobw_worker.py): each rank's results."""
    return run_saved_runs(tmp_path_factory.mktemp("twobw"), "twobw_worker", RANKS)


def _unequal(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if not torch.equal(v, ref[k])]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_every_stage_ends_bitwise_where_the_2bw_rule_by_hand_ends(runs, optimizer):
    restart = FLUSH_AFTER if optimizer == "sgd" else None  # the SGD run flushes mid-way: the delay restarts
    ref = reference_2bw(optimizer, RANKS, restart=restart)
    no_delay = reference_2bw(optimizer, RANKS, restart=restart, delay=0)
    for rank in range(RANKS):
        state = runs[rank][optimizer]["state"]
        assert len(state) == 4  # two layers a stage, a weight and a bias each
        assert _unequal(state, ref) == [], f"stage {rank} left W(t+1) = W(t) - lr * grad f(W(t-1))"
        assert set(_unequal(state, no_delay)) == set(state)  # the delay is observable: the test can tell


def test_every_stage_holds_two_weight_versions_as_in_the_papers_table_1(runs):
    for rank in range(RANKS):
        adam = runs[rank]["adam"]
        assert adam["peak_versions"] == 2  # distinct versions: the period's and the newest
        assert all(len(held) <= 2 for run in ("sgd", "adam") for held in runs[rank][run]["held"])
    # at the end of step s stage 0 still runs period s on W(s-1) while the live weights are W(s); the last
    # stage has applied the update of period s and keeps W(s) for period s+1
    assert runs[0]["adam"]["held"] == [[0]] + [[s - 1, s] for s in range(1, PERIODS)]
    assert runs[1]["adam"]["held"] == [[s, s + 1] for s in range(PERIODS)]
    # stashed copies beside the live weights: two buffers where micro-batches of the next period are in flight
    # when a period ends, one on the last stage (its backward follows its forward at once)
    assert [runs[r]["adam"]["peak_stashed"] for r in range(RANKS)] == [2, 1]


def test_vpipe_under_2bw_trains_bitwise_like_the_schedule_alone(runs):
    for rank in range(RANKS):
        plain, attached = runs[rank]["adam"], runs[rank]["attached"]
        assert _unequal(attached["state"], plain["state"]) == []  # every block recomputed, planning off
        assert attached["losses"] == plain["losses"]
        assert attached["kind"] == "pipedream_2bw" and attached["move_refusal"] is None
    assert all(len(step) == MICRO_BATCHES for step in runs[1]["adam"]["losses"])


def test_blocks_streamed_both_ways_under_2bw_end_bitwise_as_the_schedule_alone(runs):
    """2BW runs every stage on one version, so where a block trained does not change
    it: a run from 3,1 with a block moved to stage 1 at step 2 and back at step 5
    (the last) ends as the plain run on 2,2, bit for bit."""
    moved = {k: v for r in range(RANKS) for k, v in runs[r]["moved"]["state"].items()}
    plain = {k: v for r in range(RANKS) for k, v in runs[r]["adam"]["state"].items()}
    assert [runs[0]["moved"]["layers"][s] for s in (1, 2, 4, 5)] == [[0, 1, 2], [0, 1], [0, 1], [0, 1, 2]]
    assert [runs[1]["moved"]["layers"][s] for s in (1, 2, 4, 5)] == [[3], [2, 3], [2, 3], [3]]
    assert sorted(runs[0]["moved"]["state"]) == [f"{i}.0.{n}" for i in range(3) for n in ("bias", "weight")]
    assert sorted(moved) == sorted(plain) and _unequal(moved, plain) == []
    assert runs[1]["moved"]["losses"] == runs[1]["adam"]["losses"]
    assert max(runs[r]["moved"]["peak_versions"] for r in range(RANKS)) == 2


def test_a_micro_batch_runs_on_the_weights_of_two_periods_back_never_before_the_start():
    m = 3
    assert [period_version(mb, m) for mb in range(12)] == [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    # after a flush at period 4 with 4 updates applied, periods 4 and 5 run on W(4)
    assert [period_version(mb, m, 4, 4) for mb in range(12, 21)] == [4, 4, 4, 4, 4, 4, 5, 5, 5]


def test_the_labs_pipedream2bw_schedule_trains_as_its_single_process_reference(tmp_path):
    cfg = RunConfig(stages=2, schedule="pipedream2bw", steps=3, blocks=2, d_model=16, n_heads=2, seq_len=8,
                    dropout=0.0, micro_batches=2, micro_batch_size=2)
    proc = run_vpipe("train", "--stages", "2", "--schedule", "pipedream2bw", "--steps", "3", "--blocks", "2",
                     "--d-model", "16", "--n-heads", "2", "--seq-len", "8", "--dropout", "0",
                     "--micro-batches", "2",
                     "--micro-batch-size", "2", "--out-dir", str(tmp_path), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, want_losses, _ = reference.reference_2bw(cfg)
    assert_params_equal(load_run_params(tmp_path, 2), want)  # bitwise
    assert json.loads((tmp_path / "rank1.json").read_text())["losses"] == want_losses
    flush, _, _ = reference.reference_flush(dataclasses.replace(cfg, schedule="1f1b"))
    assert any(not want[k].equal(v) for k, v in flush.items())  # 2BW's delay is not the flush schedules' rule


def test_the_lab_refuses_what_a_2bw_stream_cannot_do():
    for extra, said in ([{"checkpoint_dir": "x"}, "checkpoints need a flush schedule (any but pipedream2bw)"],
                        [{"nas": [{"step": 1, "remove": [1]}], "vpipe": True},
                         "layer edits need a flush schedule"],
                        [{"micro_batches": 1}, "pipedream2bw needs micro_batches >= stages"]):
        with pytest.raises(ValueError, match=re.escape(said)):
            RunConfig(stages=2, schedule="pipedream2bw", blocks=2, **extra)
