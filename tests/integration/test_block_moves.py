"""Every block moves whole: trainers with everyday blocks, moved by vpipe, train exactly like without it.

Each scenario of ``tests/workers/block_worker.py`` runs on two real ranks (6,2 split, blocks moved
6,2 -> 4,4 -> 5,3 by plans vpipe is given) next to the same trainer without vpipe; the
losses, and every parameter and buffer of the whole model, must be bitwise equal.
"""

from __future__ import annotations

from pathlib import Path

from support.processes import run_worker


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


def _events(log: list[dict], event: str) -> list[dict]:
    return [r for r in log if r.get("event") == event]


def test_blocks_with_user_hooks_stay_with_their_hooks_and_each_refusal_says_why(tmp_path):
    result = run_blocks(tmp_path, "hooked")
    assert result["placement"] == [[0, 1, 2, 3, 4, 5], [6, 7]]  # both plans moved block 4 or 5: refused
    assert_trains_like_plain(result)  # the hooks (one counting its calls) ran on every step, as without vpipe
    off = _events(result["log"], "moves_off")
    assert [(r["stage"], r["layers"]) for r in off] == [(0, [4, 5])]
    assert off[0]["msg"] == ("stage 0: layers [4, 5] never move to another stage: layer 4 carries forward "
                             "hook CountingHook (hooks cannot be carried to another process); layer 5 "
                             "carries forward hook hooked.<locals>.prepare.<locals>.<lambda> (hooks cannot "
                             "be carried to another process)")
    refused = _events(result["log"], "migration_refused")
    assert [r["msg"] for r in refused] == [
        "stage 0 cannot send layers [4, 5]: layer 4 carries forward hook CountingHook (hooks "
        "cannot be carried to another process)",
        "stage 0 cannot send layers [5]: layer 5 carries forward hook "
        "hooked.<locals>.prepare.<locals>.<lambda> (hooks cannot be carried to another process)"]
    assert len(_events(result["log"], "migration_aborted")) == 4  # each plan, on both ranks


def test_blocks_that_share_a_module_never_move_and_the_others_still_do(tmp_path):
    result = run_blocks(tmp_path, "shared")
    assert result["placement"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 4 and 5 moved, 2 (shared with 1) did not
    assert moved_layers(result["log"]) == [[4, 5], [4, 5]]
    assert_trains_like_plain(result)
    off = _events(result["log"], "moves_off")
    assert [(r["stage"], r["layers"]) for r in off] == [(0, [1, 2])]
    assert off[0]["msg"] == ("stage 0: layers [1, 2] never move to another stage: layer 1 "
                             "shares proj.weight with layers [2]; layer 2 shares proj.weight with layers [1]")
    assert [r["msg"] for r in _events(result["log"], "migration_refused")] == [
        "stage 0 cannot send layers [2, 3]: layer 2 shares proj.weight with layers [1]"]


# inductor compiles on CPU: about 25 s per run of two ranks on two cores
def test_blocks_wrapped_by_torch_compile_move_as_their_class_and_are_compiled_alike(tmp_path):
    result = run_blocks(tmp_path, "compiled")
    assert result["placement"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert moved_layers(result["log"])
    assert not _events(result["log"], "migration_refused")
    assert_trains_like_plain(result)  # bitwise: the same inductor kernels run the same blocks
    assert "layers.5._orig_mod.fc.weight" in result["states"]["vpipe"]  # still compiled where it arrived


def test_blocks_compiled_in_place_with_fullgraph_train_and_move(tmp_path):
    result = run_blocks(tmp_path, "compiled_in_place")
    assert result["placement"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert moved_layers(result["log"])
    assert_trains_like_plain(result)
    assert result["compiled_calls"] == [True] * 5
