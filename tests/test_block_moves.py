"""Every block moves whole: trainers with everyday blocks, moved by vpipe, train exactly like without it.

Each scenario of ``tests/block_worker.py`` runs on two real ranks (6,2 split, blocks moved
6,2 -> 4,4 -> 5,3 by plans vpipe is given) next to the same trainer without vpipe; the
losses, and every parameter and buffer of the whole model, must be bitwise equal.
"""

from __future__ import annotations

from pathlib import Path

from conftest import run_worker


def run_blocks(tmp_path: Path, scenario: str, ranks: int = 2) -> dict:
    return run_worker(tmp_path, "block_worker", scenario, ranks)


def moved_layers(log: list[dict]) -> list[list[int]]:
    return [layers for r in log if r.get("event") == "migration_done" for layers in r["moved"]]


def assert_trains_like_plain(result: dict) -> None:
    assert result["losses"]["vpipe"] == result["losses"]["plain"]  # bitwise, every micro-batch of every step
    plain, moved = result["states"]["plain"], result["states"]["vpipe"]
    assert plain.keys() == moved.keys()
    for name, want in plain.items():
        assert moved[name] == want, name


def test_blocks_with_batchnorm_and_int64_bool_float64_buffers_move_under_adam(tmp_path):
    result = run_blocks(tmp_path, "buffers_adam")
    assert result["placement"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert moved_layers(result["log"]), "the blocks should have moved"
    assert_trains_like_plain(result)
    assert result["states"]["vpipe"]["layers.5.bn.num_batches_tracked"] == 9 * 4  # 9 steps of 4 micro-batches


def test_blocks_with_batchnorm_and_int64_bool_float64_buffers_move_under_sgd_momentum(tmp_path):
    result = run_blocks(tmp_path, "buffers_sgd")
    assert result["placement"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert moved_layers(result["log"])
    assert_trains_like_plain(result)


def test_a_recomputed_batchnorm_block_leaves_its_statistics_and_counters_as_one_forward_does(tmp_path):
    result = run_blocks(tmp_path, "recompute_norm")
    assert result["recomputes"] > 0  # the blocks' activations were recomputed in the backward
    assert_trains_like_plain(result)  # running stats, num_batches_tracked, the user's counter: bitwise
    assert result["states"]["vpipe"]["layers.0.bn.num_batches_tracked"] == 9 * 4
    assert result["states"]["vpipe"]["layers.0.calls"] == 9 * 4
