"""WPipe (``vpipe.ScheduleWPipe``) on two real gloo ranks, two stages each (G0's and G1's), against its
update rule written out by hand in one process (support/wpipe.py): every stage's weights bit for bit, for
SGD and Adam; the weight versions each group holds (the WPipe paper's Table 1: two for G0, one for G1);
vpipe under it (every block recomputed, swapped or kept, planning off; or the planner running) changing
nothing; and the lab's ``--schedule wpipe``. Blocks moved under it: tests/integration/test_wpipe_moves.py."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from support.processes import run_saved_runs, run_vpipe
from support.results import assert_params_equal, load_run_params
from support.wpipe import FLUSH_AFTER, MICRO_BATCHES, PERIODS, RECOMPUTE_AT, layers, reference_wpipe
from vpipe_lab.runtime import reference
from vpipe_lab.runtime.config import RunConfig

RANKS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """One launch, seven runs (see tests/workers/wpipe_worker.py): each rank's results."""
    return run_saved_runs(tmp_path_factory.mktemp("wpipe"), "wpipe_worker", RANKS)


def _unequal(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if not torch.equal(v, ref[k])]


def _group(name: str) -> int:
    return int(int(name.split(".")[0]) >= layers(RANKS) // 2)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_every_stage_ends_bitwise_where_the_2gw_rule_by_hand_ends(runs, optimizer):
    """W0(t+1) = W0(t) - lr * grad_0 f(W0(t-1), W1(t)) and W1(t+1) = W1(t) - lr * grad_1 f(W0(t-1), W1(t))."""
    restart = FLUSH_AFTER if optimizer == "sgd" else None  # the SGD run flushes mid-way: G0's delay restarts
    ref = reference_wpipe(optimizer, RANKS, restart=restart)
    no_delay = reference_wpipe(optimizer, RANKS, restart=restart, delays=(0, 0))  # the flush schedules' rule
    both_delayed = reference_wpipe(optimizer, RANKS, restart=restart, delays=(1, 1))  # 2BW's rule
    for rank in range(RANKS):
        state = runs[rank][optimizer]["state"]
        # G0's stage r holds layers 2r, 2r+1; G1's stage W + r layers
        # 2(W + r), 2(W + r) + 1: a weight, a bias each
        assert sorted({int(k.split(".")[0]) for k in state}) == [2 * rank, 2 * rank + 1, 2 * (RANKS + rank),
                                                                   2 * (RANKS + rank) + 1]
        assert _unequal(state, ref) == [], f"rank {rank} left the 2GW rule"
        # the delay of each group is observable: without G0's the rule differs, with G1's too
        assert set(_unequal(state, no_delay)) == set(state)
        assert set(_unequal(state, both_delayed)) == set(state)
        assert runs[rank][optimizer]["updates"] == [PERIODS, PERIODS]  # each group one update a period


def test_g0_holds_two_weight_versions_and_g1_one_as_in_the_papers_table_1(runs):
    for rank in range(RANKS):
        for name in ("sgd", "adam"):
            run = runs[rank][name]
            assert run["peak_versions"] == [2, 1]  # distinct versions held at once: G0 two, G1 one
            # G0's copies beside its live weights; G1 runs on its live ones
            assert run["peak_stashed"] == [2, 0]
        # at the end of step s G0 has applied the update of period s - 1 (W0(s))
        # and keeps W0(s-1), which period s (in flight until step s + 1) runs on;
        # G1 has applied period s's update and holds W1(s+1) alone
        assert runs[rank]["adam"]["held"] == [[[0], [1]]] + [[[s - 1, s], [s + 1]] for s in range(1, PERIODS)]
        # after the flush before period 3 every update is applied: periods 3 and 4 both run G0 on W0(3)
        assert runs[rank]["sgd"]["held"][FLUSH_AFTER:] == [[[3], [4]], [[3, 4], [5]], [[4, 5], [6]]]
    assert [len(step) for step in runs[RANKS - 1]["adam"]["losses"]] == [MICRO_BATCHES] * PERIODS


def test_vpipe_under_wpipe_recomputes_every_block_and_trains_bitwise_like_the_schedule_alone(runs):
    for rank in range(RANKS):
        plain, attached = runs[rank]["adam"], runs[rank]["attached"]
        assert _unequal(attached["state"], plain["state"]) == []
        assert attached["losses"] == plain["losses"]
        assert attached["kind"] == "wpipe" and attached["stages"] == [rank, RANKS + rank]
        # every layer of both of the rank's stages recomputed once for each micro-batch's backward
        mine = [2 * rank, 2 * rank + 1, 2 * (RANKS + rank), 2 * (RANKS + rank) + 1]
        assert attached["recomputes"] == dict.fromkeys(mine, PERIODS * MICRO_BATCHES)
        # blocks move (tests/integration/test_wpipe_moves.py): attach logs no moves_off line
        assert attached["move_refusal"] is None and attached["moves_off"] == []
        assert attached["peak_versions"] == [2, 1]


def test_under_wpipe_swapped_blocks_a_budget_and_a_running_planner_change_nothing(runs):
    for rank in range(RANKS):
        plain = runs[rank]["adam"]
        mine = [2 * rank, 2 * rank + 1, 2 * (RANKS + rank), 2 * (RANKS + rank) + 1]
        for name, policy in (("swapped", "S"), ("planned", "D"), ("kept", "R")):
            run = runs[rank][name]
            assert _unequal(run["state"], plain["state"]) == [] and run["losses"] == plain["losses"], name
            assert run["policies"] == {str(lid): policy for lid in mine}
        # G0's saved activations went to the host across steps
        assert runs[rank]["swapped"]["swapped_bytes"] > 0
        assert runs[rank]["planned"]["swapped_bytes"] == 0
        # every block kept, nothing measured: the stages go quiet (their own methods, no manager),
        # G1's at step 2, G0's at step 3 with its period 2 in flight across the boundary; a plan
        # (policies only) has every block recomputed from step 4 on: the managers take over again
        # (G0's counting period 3, whose forwards ran quiet and kept, as in flight) and recompute
        # the micro-batches of periods 4 and 5 in both groups
        kept = runs[rank]["kept"]
        assert kept["plain"] == [[False, False]] * 2 + [[False, True], [True, True]] + [[False, False]] * 2
        assert kept["recomputes"] == dict.fromkeys(mine, (PERIODS - RECOMPUTE_AT + 1) * MICRO_BATCHES)
    # a rank budget too small for rank 0's G0 stage at its peak (5 micro-batches) with
    # every layer kept: that stage's layers are swapped to stay within it, rank 1's
    # and both G1 stages keep theirs; bitwise all the same
    budget = [runs[rank]["budget"] for rank in range(RANKS)]
    assert [run["policies"] for run in budget] == [{"0": "S", "1": "S", "4": "D", "5": "D"},
                                                   {"2": "D", "3": "D", "6": "D", "7": "D"}]
    assert budget[0]["swapped_bytes"] > 0
    for rank in range(RANKS):
        assert _unequal(budget[rank]["state"], runs[rank]["adam"]["state"]) == []
        assert budget[rank]["losses"] == runs[rank]["adam"]["losses"]


def test_the_labs_wpipe_schedule_trains_as_its_single_process_reference(tmp_path):
    cfg = RunConfig(stages=2, schedule="wpipe", steps=3, blocks=2, d_model=16, n_heads=2, seq_len=8,
                    dropout=0.0, micro_batches=2, micro_batch_size=2)
    proc = run_vpipe("train", "--stages", "2", "--schedule", "wpipe", "--steps", "3", "--blocks", "2",
                     "--d-model", "16", "--n-heads", "2", "--seq-len", "8", "--dropout", "0",
                     "--micro-batches", "2",
                     "--micro-batch-size", "2", "--out-dir", str(tmp_path), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["stages"] == [0, 2] and rank0["stage_layer_ids"] == [[0], [2]]  # G0's stage 0, G1's stage 2
    want, want_losses = reference.reference_wpipe(cfg)
    assert_params_equal(load_run_params(tmp_path, 2), want)  # bitwise
    assert json.loads((tmp_path / "rank1.json").read_text())["losses"] == want_losses
    two_bw, _, _ = reference.reference_2bw(dataclasses.replace(cfg, schedule="pipedream2bw"))
    assert any(not want[k].equal(v) for k, v in two_bw.items())  # G1 without the delay: not 2BW's rule


def test_the_lab_refuses_what_a_wpipe_stream_cannot_do():
    for extra, said in ([{"checkpoint_dir": "x"}, "checkpoints need a flush schedule (any but wpipe)"],
                        [{"nas": [{"step": 1, "remove": [1]}], "vpipe": True},
                         "layer edits need a flush schedule"],
                        [{"moves": [{"step": 1, "partition": [1, 1, 2, 1]}], "vpipe": True},
                         "moves[0]: partition [1, 1, 2, 1] moves layers between wpipe's groups; its first 2 "
                         "stages (G0) keep 3 layers"],
                        [{"stages_per_rank": 3}, "wpipe runs exactly 2 stages per rank (G0's and G1's)"],
                        [{"micro_batches": 1}, "wpipe needs micro_batches >= stages"]):
        with pytest.raises(ValueError, match=re.escape(said)):
            RunConfig(stages=2, schedule="wpipe", blocks=3, **extra)
