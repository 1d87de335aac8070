"""A trainer's own DCP checkpoint, saved after vpipe moved its blocks, loads into the trainer without vpipe.

torchtitan saves a pipeline stage with ``torch.distributed.checkpoint``: ``get_state_dict`` of
the model and the optimizer (flattened), ``dcp.save``; resuming builds the stage for its own
split, ``dcp.load`` and ``set_state_dict``. After vpipe moved blocks (a 6,2 split rebalanced by
the one line), that checkpoint must resume the trainer without vpipe on any split (6,2 and
2,6 here) and train exactly as the run that never stopped (bitwise on CPU). The tutorial's
``ModuleDict`` keys blocks by global id and needs nothing; an ``nn.Sequential`` slice numbers
its blocks ``0..n-1`` on every stage and renames them with ``vpipe.global_block_keys`` /
``vpipe.local_block_keys`` around the save and the load (without them, the stages' keys collide).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.processes import WORKERS, run_ranks
from vpipe.checkpoint.block_keys import global_block_keys, local_block_keys


def _run(tmp_path: Path, shape: str) -> dict:
    out = tmp_path / f"{shape}.json"
    run_ranks([str(WORKERS / "dcp_worker.py"), shape, str(out), str(tmp_path / "ckpt")], 2,
              tmp_path / f"{shape}.txt", timeout_s=240)
    return json.loads(out.read_text())


@pytest.mark.parametrize("shape", [
    # 25-40 s on 2 shared cores (nothing of vpipe's to test here)
    pytest.param("tutorial", marks=pytest.mark.slow),
    "sequential",  # 15-30 s: the renamed keys, end to end
])
def test_a_dcp_checkpoint_after_moves_resumes_the_plain_trainer_on_any_split_bitwise(tmp_path, shape):
    result = _run(tmp_path, shape)
    first, last = result["ranks"]
    moved = [len(first["moved_to"]), len(last["moved_to"])]
    # vpipe moved blocks before the save
    assert moved != [6, 2] and sum(moved) == 8, (moved, last["saved_at"])
    assert last["never_stopped"] and all(len(step) == 4 for step in last["never_stopped"])
    for split in ("6,2", "2,6"):
        assert last["resumed"][split] == last["never_stopped"], split  # bitwise, every micro-batch
    held = result["blocks_in_checkpoint"]
    if shape == "sequential":  # renamed, every block is in the checkpoint; without, the stages' keys collide
        assert held["named"] == [f"model.{i}" for i in range(8)]
        assert held["unnamed"] == [f"model.{i}" for i in range(max(moved))]
    else:
        assert held == {"named": [f"model.layers.{i}" for i in range(8)]}  # the ModuleDict's own global ids


def test_block_keys_follow_the_block_for_model_and_flattened_optimizer_keys():
    sd = {"0.up.weight": 1, "1.up.weight": 2, "state.1.down.bias.exp_avg": 3,
          "param_groups.0.up.weight.lr": 4,
          "norm.weight": 5}
    named = global_block_keys(sd, [5, 6])
    assert named == {"5.up.weight": 1, "6.up.weight": 2, "state.6.down.bias.exp_avg": 3,
                     "param_groups.5.up.weight.lr": 4, "norm.weight": 5}
    assert local_block_keys(named, [5, 6]) == sd
    hf = {"h.0.attn.c_attn.weight": torch.zeros(1), "wte.weight": torch.zeros(1)}
    assert list(global_block_keys(hf, [3], container="h")) == ["h.3.attn.c_attn.weight", "wte.weight"]
    with pytest.raises(ValueError, match=r"key '1.up.weight' names local block 1, but the stage has 1 block"):
        global_block_keys(sd, [5])
    with pytest.raises(ValueError, match=r"key '5.up.weight' names layer 5, which is not one of this stage's "
                                         r"layer_ids \[6\]"):
        local_block_keys(named, [6])
    with pytest.raises(ValueError, match=r"layer_ids must be distinct non-negative integers, got \[1, 1\]"):
        global_block_keys(sd, [1, 1])


def test_a_rollback_to_a_snapshot_taken_before_a_move_trains_as_the_plain_trainers_rollback(tmp_path):
    """A loss-spike rollback across a move: the plain trainer's deep copy of the stage's state dict is
    refused in one line naming the blocks that moved; the DCP snapshot with global block keys restores
    every block where it lives now, and the replayed steps equal the plain trainer's rollback bitwise."""
    result = _run(tmp_path, "rollback")
    first, last = result["ranks"]
    assert first["snapshot"] == [0, 1, 2, 3, 4, 5] and first["moved_to"] != first["snapshot"]
    refusal = first["refusal"]
    assert refusal is not None and refusal.startswith("vpipe: this stage module state dict holds blocks "
                                                      "[0, 1, 2, 3, 4, 5], the stage holds ")
    assert (
        "left since it was taken); snapshot with torch.distributed.checkpoint and vpipe.global_block_keys"
        in refusal
    )
    assert last["replayed"] == last["plain"] and all(len(step) == 4 for step in last["plain"])
