"""DeepSpeed's pipeline engine with the one line ``vpipe.attach(engine)``, side by side with DeepSpeed alone.

The trainer is examples/train_deepspeed.py's (tests/workers/deepspeed_worker.py runs it):
DeepSpeed's uniform partition of an embedding, 8 blocks (the first four heavier) and a head
over 2 stages. In each launch a plain engine and an engine with vpipe, built alike, train
on the same batches; moves are forced at fixed steps (the planner's own moves are the
benchmark's, ``benchmarks/deepspeed_balance.py``). fp32 moves change which rank computes a
layer, never an order of arithmetic, so losses and parameters are bitwise equal. Slow: each
launch imports DeepSpeed on every rank, and the first one on a machine builds its
communication op (about two minutes).
"""

from __future__ import annotations

import pytest

from support.processes import run_worker

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the deepspeed extra)")
# the first DeepSpeed launch on a machine builds its CPU communication op (about two minutes on 2 cores)
FIRST_RUN_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(FIRST_RUN_S + 60)]

HOME = [[1, 2, 3, 4], [5, 6, 7, 8]]


def _run(tmp_path, scenario: str, ranks: int) -> dict:
    return run_worker(tmp_path, "deepspeed_worker", scenario, ranks, timeout_s=FIRST_RUN_S)

MOVED = [[1, 2, 3], [4, 5, 6, 7, 8]]


def _events(result: dict, event: str) -> list[dict]:
    return [r for r in result["log"] if r.get("event") == event]


def _assert_as_deepspeed_alone(result: dict) -> None:
    assert result["vpipe"] == result["plain"]  # bitwise, every step
    assert result["layers"]["vpipe"] == result["layers"]["plain"]  # every layer's every tensor
    assert len(result["layers"]["plain"]) > 30


def test_moves_keep_the_losses_and_a_checkpoint_after_them_resumes_in_deepspeed_alone(tmp_path):
    result = _run(tmp_path, "moves", 2)
    _assert_as_deepspeed_alone(result)
    # two forced plans moved blocks both ways; the save moved them home and back
    assert result["placements"][2] == [[1, 2], [3, 4, 5, 6, 7, 8]]
    assert result["placements"][4] == result["placements"][6] == [[1, 2, 3, 4, 5], [6, 7, 8]]
    assert [r["msg"].split(": ")[1] for r in _events(result, "checkpoint_placement") if r["rank"] == 0] == [
        "layers moved home for DeepSpeed's save_checkpoint", "layers moved back after "
                                                             "DeepSpeed's save_checkpoint"]
    # DeepSpeed's own file per layer, named by global index, and one optimizer file per stage
    assert result["files"] == [f"layer_{i:02d}-model_states.pt" for i in range(10)] + [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    # DeepSpeed alone on its own partition resumed from it: the next losses and the parameters are the same
    assert result["resumed"] == result["vpipe"][6:]
    assert result["layers"]["resumed"] == result["layers"]["vpipe"]
    # the engine runs and names what vpipe moved as it would have built it: layers 0-5 and 6-9
    stage0, stage1 = result["forward_funcs"]["stages"]
    assert stage0["parts"] == stage1["parts"] == [0, 6, 10]
    assert stage0["funcs"] == ["Embedding"] + ["Block"] * 5 and stage1["funcs"] == ["Block"] * 3 + ["Head"]
    assert stage1["registered"] == ["6", "7", "8", "9"] and stage1["fwd_map"] == {"6": 0, "7": 1, "8": 2,
                                                                                  "9": 3}
    assert not _events(result, "stale_references")  # the engine's names of the parameters follow the moves
    assert result["edit_refused"].startswith("remove_layers cannot edit a DeepSpeed PipelineModule")
    assert result["module_refused"].startswith(
        "vpipe.attach takes DeepSpeed's engine, not its PipelineModule"
    )


def test_swapped_and_recomputed_layers_train_as_deepspeed_alone(tmp_path):
    result = _run(tmp_path, "policies", 2)
    _assert_as_deepspeed_alone(result)
    assert result["placements"][-1] == MOVED
    # stage 0 swapped block 1, recomputed block 2
    assert result["d2h_bytes"] > 0 and result["recompute_s"] > 0


@pytest.mark.parametrize("scenario, ranks", [("checkpointing", 2), ("tied", 2), ("replicas", 4)])
def test_deepspeeds_own_checkpointing_a_tied_head_and_replicas_move_with_the_same_losses(tmp_path, scenario,
                                                                                         ranks):
    result = _run(tmp_path, scenario, ranks)
    _assert_as_deepspeed_alone(result)
    moved = [[1, 2, 3], [4, 5, 6, 7, 8]]
    home = [[1, 2, 3, 4, 5], [6, 7, 8]] if scenario == "tied" else HOME
    assert result["placements"][0] == home and result["placements"][-1] == moved
    off = _events(result, "tensor_manager_off")
    if scenario == "checkpointing":  # DeepSpeed recomputes the blocks: vpipe never does it twice
        assert not result["tensor_manager"] and len(off) == 2
        assert "activation_checkpoint_interval=1" in off[0]["msg"]
    else:
        assert result["tensor_manager"] and not off
    if scenario == "tied":  # the tied embedding and head are not blocks: they stay, said once per stage
        pinned = [r for r in _events(result, "moves_off") if r.get("reason") == "fixed layers"]
        assert sorted(r["stage"] for r in pinned) == [0, 1]
        assert "TiedLayerSpec" in pinned[0]["msg"]


@pytest.mark.parametrize("scenario, ranks, why", [
    ("bf16", 2, "DeepSpeed bf16/fp16: its optimizer keeps flat fp32 master copies"),
    ("zero1", 4, "DeepSpeed ZeRO stage 1: its optimizer flattens and partitions"),
])
def test_bf16_and_zero1_are_refused_moves_in_one_line_and_train_as_deepspeed_alone(tmp_path, scenario, ranks,
                                                                                   why):
    result = _run(tmp_path, scenario, ranks)
    _assert_as_deepspeed_alone(result)
    assert result["moves_off"].startswith(why)
    assert all(p == HOME for p in result["placements"])
    off = [r for r in _events(result, "moves_off") if r.get("reason", "").startswith(why)]
    assert sorted(r["rank"] for r in off) == list(range(ranks))  # one line per rank
    assert {r["rank"] for r in _events(result, "plan_skipped")} == set(range(ranks))


def test_a_grid_with_a_model_axis_is_refused_moves_in_one_line(tmp_path):
    result = _run(tmp_path, "model_parallel", 4)
    assert result["moves_off"].startswith("DeepSpeed tensor model parallelism (2 ranks on "
                                          "the grid's model axis)")
    assert sorted(r["rank"] for r in _events(result, "moves_off")) == [0, 1, 2, 3]


def test_a_move_that_changes_what_a_stage_sends_resizes_deepspeeds_p2p_buffers(tmp_path):
    result = _run(tmp_path, "shapes", 2)
    assert result["vpipe"] == result["plain"]
    assert result["placements"][2] == [[1, 2, 3], [4, 5, 6, 7, 8]]  # stage 0 sends the whole sequence
    assert result["placements"][4] == [[1, 2, 3, 4, 5], [6, 7, 8]]  # and the halved one again
    done = [r for r in result["log"] if r.get("event") == "migration_done" and r["rank"] == 0]
    assert [r["rebuilt"] for r in done] == [True, True]  # each move told every rank to resize
