"""FSDP2 pipelines inside a mesh, torchtitan's way: 2 stages x 2 data-parallel shards on 4 real ranks.

``fully_shard`` on every block and on each stage module over the mesh's dp dimension; the same
trainer runs side by side without vpipe. With only ``vpipe.attach(schedule, optimizer=opt)``
added, blocks of the 6,2 split move under 1F1B (each dp rank sends its own shards of the
block's parameters and Adam moments to the rank with its dp coordinate on the other stage),
the losses stay those of the plain run, and the gathered parameters equal the plain run's.
"""

from __future__ import annotations

import torch

from support.processes import run_worker
from support.results import assert_losses_close, assert_params_equal

REL = 1e-6


def _assert_as_without_vpipe(ranks: list[dict]) -> None:
    assert_losses_close(ranks, REL)
    full = {copy: {} for copy in ("plain", "vpipe")}  # dp coordinate -> the whole model, by global key
    for copy, replicas in full.items():
        for r in ranks:
            replicas.setdefault(r["coords"]["dp"], {}).update(
                {k: torch.tensor(v) for k, v in r["states"][copy].items()})
    assert_params_equal(full["vpipe"][1], full["vpipe"][0])  # both dp ranks gathered the same model, bitwise
    assert_params_equal(full["vpipe"][0], full["plain"][0], rtol=REL)


def test_fsdp2_stages_move_sharded_blocks_and_train_as_without_vpipe(tmp_path):
    result = run_worker(tmp_path, "fsdp_worker", "fsdp_1f1b", 4)
    ranks = result["ranks"]
    assert not [r for r in result["log"] if r.get("event") == "moves_off"]
    placements = [r["placements"] for r in ranks]
    assert all(p == placements[0] for p in placements)  # every rank, every step: one placement
    assert any(p != [[0, 1, 2, 3, 4, 5], [6, 7]] for p in placements[0])  # moved (maybe back: 2 shared cores)
    moved = [r for r in result["log"] if r.get("event") == "migration_done" and r.get("moved")]
    assert {r["rank"] for r in moved} == {0, 1, 2, 3}
    _assert_as_without_vpipe(ranks)


def test_interleaved_1f1b_with_fsdp2_and_an_optimizer_per_model_part_trains_as_without_vpipe(tmp_path):
    """Two stages per rank, each fully_shard-ed, one AdamW per model part in torchtitan's container. The
    planner may or may not move blocks in the steps run; a forced plan moves two (one each way between the
    ranks), and each arrives in the optimizer of the stage it lands on."""
    ranks = run_worker(tmp_path, "fsdp_worker", "fsdp_interleaved", 4)["ranks"]
    placements = [r["placements"] for r in ranks]
    assert all(p == placements[0] for p in placements)
    assert placements[0][3] == [[0, 1], [2, 3, 4], [5, 6], [7]]
    assert all(r["parts_hold_their_stages"] for r in ranks)
    _assert_as_without_vpipe(ranks)
