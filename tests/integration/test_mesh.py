"""A pipeline that is one dimension of a mesh: 2 stages x 2 data-parallel replicas on 4 real ranks.

The torch pipelining tutorial's model, split 6,2, trains under GPipe with the trainer's own
gradient all-reduce over its dp group, on a mesh in either dimension order (stage index,
pipeline-group rank and world rank differ). The same trainer runs side by side without vpipe.
The only change is ``vpipe.attach(schedule, optimizer=opt)``: blocks move, every replica
holds the same blocks at every step, losses stay those of the plain run, and at the end the
replicas' parameters are bitwise equal and equal the plain run's. One planner (the leading
replica's) sees every replica's records, combined per stage as the slowest / fullest. Sharding across the
pipeline's own ranks and ``replicate()`` are refused with a message that says what to do (FSDP2:
``test_mesh_fsdp.py``; tensor parallelism: ``test_tensor_parallel.py``).
"""

from __future__ import annotations

import pytest
import torch

from support.processes import assert_death_mid_move_stops_everyone, run_worker
from support.results import assert_losses_close, assert_params_equal

REL = 1e-6


def _replica_params(ranks: list[dict], copy: str) -> dict[int, dict[str, torch.Tensor]]:
    """Each replica's whole model (its ranks' state dicts merged by global key)."""
    merged: dict[int, dict[str, torch.Tensor]] = {}
    for r in ranks:
        merged.setdefault(r["coords"]["dp"], {}).update({k: torch.tensor(v)
                                                         for k, v in r["states"][copy].items()})
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("order", ["dp_pp", "pp_dp"])
def test_replicas_of_a_pipeline_move_blocks_alike_and_train_as_without_vpipe(tmp_path, order):
    result = run_worker(tmp_path, "mesh_worker", order, 4)
    ranks = result["ranks"]
    # the planner saw every replica: each sampled step, the followers' records reached the leader in time
    assert not [r for r in result["log"] if "did not arrive" in r.get("msg", "")]
    assert [r for r in result["log"] if r.get("event") == "plan_applied"]
    # stage index, pipeline rank and world rank differ: (dp, pp) puts stage 1 of replica 0 on world rank 1,
    # (pp, dp) on world rank 2
    stage1 = [r["rank"] for r in ranks if r["coords"] == {"dp": 0, "pp": 1}]
    assert stage1 == ([1] if order == "dp_pp" else [2])
    placements = [r["placements"] for r in ranks]
    assert all(p == placements[0] for p in placements)  # every rank, every step: one placement
    assert any(p != [[0, 1, 2, 3, 4, 5], [6, 7]] for p in placements[0])  # moved (maybe back: 2 shared cores)
    _assert_as_without_vpipe(ranks)


@pytest.mark.slow
def test_interleaved_1f1b_with_two_stages_per_rank_attaches_inside_a_mesh_and_trains_as_without_vpipe(
    tmp_path,
):
    """Moves are optional here (the planner may or may not find one worth it in the steps run): replicas still
    hold one placement at every step and train exactly as the plain run."""
    ranks = run_worker(tmp_path, "mesh_worker", "interleaved", 4)["ranks"]
    placements = [r["placements"] for r in ranks]
    assert all(p == placements[0] for p in placements)
    _assert_as_without_vpipe(ranks)


@pytest.mark.slow
def test_a_rank_of_the_second_replica_dying_mid_move_stops_every_rank_naming_it(tmp_path, capfd):
    """World rank 3 is stage 1 of the second replica (dp 1 of a ("dp", "pp") mesh): it dies as a forced move's
    layer reaches it, while the first replica's move goes through up to the vote that every rank takes."""
    assert_death_mid_move_stops_everyone(tmp_path, lambda: capfd.readouterr().err, "mesh_worker")


def _assert_as_without_vpipe(ranks: list[dict]) -> None:
    """Losses as the plain run's; the replicas' parameters bitwise alike and as the plain run's."""
    assert_losses_close(ranks, REL)
    vpipe_params, plain_params = _replica_params(ranks, "vpipe"), _replica_params(ranks, "plain")
    assert_params_equal(vpipe_params[1], vpipe_params[0])  # the replicas stayed replicas, bitwise
    assert_params_equal(vpipe_params[0], plain_params[0], rtol=REL)


def test_sharding_across_stages_and_replicate_on_a_stage_module_are_refused_saying_what_to_do(tmp_path):
    result = run_worker(tmp_path, "mesh_worker", "refusals", 4)
    assert result["across"].startswith("TypeError: vpipe.attach: stage ")
    assert ("DTensor parameter(s) layers.0.linear1.weight are placed on a mesh that holds "
            "other ranks of this pipeline") in result["across"]
    # Shard(0) like FSDP2's, but no FSDP2 state holds them: tensor-parallel, and welcome
    assert result["colwise"] == "attached"
    assert result["found"]["colwise"] == ["linear1.weight", "linear1.bias"]
    assert result["replicate"].startswith("TypeError: vpipe.attach does not support a "
                                          "stage module wrapped in replicate(): ")
    assert "all-reduce its gradients over the data-parallel group after schedule.step() yourself" in \
        result["replicate"]
    attached = [r for r in result["log"] if r.get("event") == "attached"]
    assert sorted(r["rank"] for r in attached) == [0, 1, 2, 3]  # the colwise case only
