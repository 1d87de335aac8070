"""Tensor-parallel blocks in a pipeline: 2 stages x 2 tp ranks, torchtitan's plan on every block, real ranks.

The model is examples/train_3d.py's. The same trainer runs side by side without vpipe, each
copy on a mesh of its own; the only change is ``vpipe.attach(schedule, optimizer=opt)``.
Each tp rank of a stage moves its own shards to the rank with its tp coordinate on the
neighbouring stage, so the losses and the whole (gathered) parameters equal the plain
run's, bitwise: a move changes which rank computes a block, never the order of a reduction
(two tp ranks sum in either order alike).
"""

from __future__ import annotations

import sys

import pytest
import torch

from support.processes import ROOT, assert_death_mid_move_stops_everyone, run_worker
from support.results import assert_params_equal
from vpipe.log import read_log

SIX_TWO = [[0, 1, 2, 3, 4, 5], [6, 7]]


def _whole(ranks: list[dict], copy: str) -> dict[str, torch.Tensor]:
    """The whole model of one copy: every rank's gathered parameters merged by global key."""
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        merged.update({k: torch.tensor(v) for k, v in r["states"][copy].items()})
    return merged


def _assert_as_without_vpipe(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["losses"]["vpipe"] == r["losses"]["plain"], r["rank"]  # bitwise, every micro-batch
    assert any(r["losses"]["plain"] for r in ranks)
    assert_params_equal(_whole(ranks, "vpipe"), _whole(ranks, "plain"))
    placements = [r["placements"] for r in ranks]
    assert all(p == placements[0] for p in placements)  # every rank, every step: one placement


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["pp_tp-1f1b", "tp_pp-gpipe", "pp_tp-gpipe", "tp_pp-1f1b"])
def test_tensor_parallel_blocks_move_shard_by_shard_and_train_as_without_vpipe(tmp_path, scenario):
    result = run_worker(tmp_path, "tp_worker", scenario, 4)
    ranks = result["ranks"]
    assert any(p != SIX_TWO for p in ranks[0]["placements"])  # moved (maybe back: 2 shared cores)
    assert not [r for r in result["log"] if r.get("event") == "moves_off"]
    _assert_as_without_vpipe(ranks)


@pytest.mark.slow
def test_interleaved_1f1b_moves_tensor_parallel_blocks_across_ranks(tmp_path):
    ranks = run_worker(tmp_path, "tp_worker", "interleaved", 4)["ranks"]
    assert ranks[0]["placements"][0] == [[0, 1, 2], [3, 4, 5], [6], [7]]
    assert ranks[0]["placements"][-1] == [[0, 1], [2, 3, 4, 5], [6], [7]]
    _assert_as_without_vpipe(ranks)


@pytest.mark.slow
def test_swapped_and_recomputed_tensor_parallel_blocks_train_as_kept_ones(tmp_path):
    """Blocks 0 and 1 swapped, 2 and 6 recomputed: their saved DTensors and local shards go to the host and
    back, and a recompute replays the block's collectives on both tp ranks alike."""
    ranks = run_worker(tmp_path, "tp_worker", "policies", 4)["ranks"]
    for r in ranks:
        swapped = r["swapped"]
        if r["coords"]["pp"] == 0:
            assert swapped["d2h_bytes"] > 0 and swapped["h2d_bytes"] == swapped["d2h_bytes"], r["rank"]
            assert swapped["dtensors"] > 0  # the blocks' redistributed inputs went too, as their local shards
            assert swapped["recomputes"]["2"] > 0
        else:
            assert swapped["d2h_bytes"] == swapped["dtensors"] == 0 and swapped["recomputes"]["6"] > 0
    _assert_as_without_vpipe(ranks)


@pytest.mark.slow
def test_a_tp_rank_dying_mid_move_stops_every_rank_naming_it(tmp_path, capfd):
    """World rank 3 is stage 1's second tp rank on a ("pp", "tp") mesh: it dies as a forced move's layer
    reaches it, while its tp peer's shard of the same layer arrives; every other rank stops, naming it."""
    assert_death_mid_move_stops_everyone(tmp_path, lambda: capfd.readouterr().err, "tp_worker")


@pytest.mark.slow
def test_three_dimensions_pp_dp_tp_move_a_block_as_fsdp2_and_tensor_parallel_shards(tmp_path):
    """8 ranks on ("pp", "dp", "tp"): FSDP2 over dp on top of tensor parallelism in every block. A forced
    move of layer 5 sends each (dp, tp) rank's 2-D shards to its peer; the arriving block is parallelised
    over tp, then sharded over dp as its donor is."""
    result = run_worker(tmp_path, "tp_worker", "pp_dp_tp", 8)
    ranks = result["ranks"]
    assert not [r for r in result["log"] if r.get("event") == "moves_off"]
    assert ranks[0]["placements"][0] == SIX_TWO and ranks[0]["placements"][-1] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert len({r["rank"] for r in result["log"] if r.get("event") == "migration_done"}) == 8
    assert not [r for r in result["log"] if r.get("event") == "stale_references"]  # FSDP2's own state is not
    _assert_as_without_vpipe(ranks)


@pytest.mark.slow
def test_the_3d_example_trains_with_the_one_line_and_saves_whole_parameters(tmp_path):
    """examples/train_3d.py as a user runs it (torchrun's environment), with --vpipe:
    every rank's saved state is the whole parameters of its stage (DTensors
    gathered), the shapes of the model built without a mesh."""
    from support.processes import child_env, run_ranks

    out = tmp_path / "run.json"
    run_ranks([str(ROOT / "examples" / "train_3d.py"), "--mesh", "tp,pp", "--steps", "4", "--vpipe", "--out",
               str(out)], 4, tmp_path / "output.txt", child_env(VPIPE_LOG_FILE=str(tmp_path / "vpipe.log")))
    import json

    losses = json.loads(out.read_text())["losses"]
    assert [len(per_rank) for per_rank in losses] == [4] * 4
    assert sum(1 for per_rank in losses if all(len(step) == 4 for step in per_rank)) == 2  # the last stage's
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_3d
    finally:
        sys.path.remove(str(ROOT / "examples"))
    whole = train_3d.Transformer(train_3d.ModelArgs()).state_dict()
    for rank in range(4):
        state = torch.load(f"{out}.rank{rank}.pt", weights_only=True)
        assert state and all(state[k].shape == whole[k].shape for k in state)
    assert [r for r in read_log(tmp_path / "vpipe.log") if r.get("event") == "attached"]
