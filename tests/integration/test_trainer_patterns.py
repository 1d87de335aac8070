"""Trainer patterns that once changed what the model learns under vpipe's moves, silently: each trains exactly
as without vpipe now, or the move is refused in one line.

Each scenario of ``tests/workers/pattern_worker.py`` runs on two real ranks (6,2
split of 8 blocks) next to the same trainer without vpipe; the losses, and every
parameter and buffer of the whole model, must be bitwise equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_block_moves import assert_trains_like_plain, moved_layers

from support.processes import run_worker


def run_pattern(tmp_path: Path, scenario: str) -> dict:
    return run_worker(tmp_path, "pattern_worker", scenario, 2)


def _events(log: list[dict], event: str) -> list[dict]:
    return [r for r in log if r.get("event") == event]


def test_gradients_accumulated_over_two_schedule_steps_move_with_their_blocks(tmp_path):
    """A plan taking effect between the two schedule.step() calls of an accumulation window: before the fix
    the moved blocks' first-half gradients stayed behind and the next optimizer step used half a gradient.
    A list of parameters the trainer took before attach is reported stale in one line."""
    result = run_pattern(tmp_path, "accumulation")
    placements = result["placements"]
    assert placements[2] == [[0, 1, 2, 3, 4, 5], [6, 7]] and placements[3] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert placements[-1] == [[0, 1, 2, 3, 4, 5], [6, 7]]  # and back, again inside a window
    assert_trains_like_plain(result)
    # the trainer's own list of the stage's parameters, taken before
    # attach, is named once per move off stage 0
    stale = [r for r in _events(result["log"], "stale_references") if r["stage"] == 0]
    assert stale, "the trainer's own parameter list names blocks that left stage 0"
    first = stale[0]
    assert first["layers"] == [4, 5] and first["count"] == 1
    assert first["holders"] == ["a list of 38 (12 of them leaving)"]
    assert "take the parameters from model.parameters() or optimizer.param_groups" in first["msg"]


def test_named_param_groups_that_differ_between_stages_keep_each_parameter_in_its_group(tmp_path):
    """Stage 0 lists [embeddings, decay, no_decay], the last stage [decay, no_decay,
    head]: before the fix moved weights landed by index (decayed weights in no_decay,
    norms and biases in head, at another learning rate)."""
    result = run_pattern(tmp_path, "groups")
    assert result["placements"][-1] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert moved_layers(result["log"])
    assert_trains_like_plain(result)


def test_a_move_into_a_stage_without_a_matching_group_is_refused_in_one_line(tmp_path):
    result = run_pattern(tmp_path, "groups_refused")
    assert result["placements"][-1] == [[0, 1, 2, 3, 4, 5], [6, 7]]  # nothing moved
    refused = _events(result["log"], "migration_refused")
    assert len(refused) == 1
    assert ("layer 4's up.weight trains in param group 1 'decay' on its stage; no param group "
            "here has its settings "
            "(the closest, group 0 'decay', has weight_decay 0.05 (not 0.1))") in refused[0]["msg"]
    assert _events(result["log"], "migration_aborted")
    assert_trains_like_plain(result)


def test_dense_and_moe_blocks_interleaved_share_one_container_and_move(tmp_path):
    """Stage 1 holds one dense and one MoE block: alone it would
    pick the MoE block's experts as its container."""
    result = run_pattern(tmp_path, "mixed")
    assert result["placements"][-1] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert [r["moved"] for r in _events(result["log"], "migration_done") if r["rank"] == 0] == [[[4, 5]],
                                                                                                [[4]],
                                                                                                [[3, 4]]]
    assert_trains_like_plain(result)  # router weights, experts and their token counts travel
    assert sum(result["states"]["vpipe"]["layers.5.tokens_per_expert"]) == 8 * 8  # 8 steps of 8 samples


@pytest.mark.slow
def test_a_block_of_a_kind_the_receiving_stage_cannot_build_is_refused_in_one_line(tmp_path):
    result = run_pattern(tmp_path, "mixed_unbuildable")
    assert result["placements"][-1] == [[0, 1, 2, 3, 4, 5, 6], [7]]  # the first plan moved, the second not
    refused = _events(result["log"], "migration_refused")
    assert len(refused) == 1 and "no block of kind MoE#" in refused[0]["msg"]
    assert_trains_like_plain(result)


def test_an_autocast_around_the_step_depends_on_the_split_unless_its_cache_is_off(tmp_path):
    """torch's own behaviour, which docs/stage-shapes.md states: no vpipe involved."""
    losses = run_pattern(tmp_path, "autocast_splits")["losses"]
    assert losses["6,2 cache=False"] == losses["4,4 cache=False"]  # bitwise, every micro-batch of 3 steps
    first_step = slice(0, 4)  # the first step's 4 micro-batches are equal; the weights it stepped to are not
    assert losses["6,2 cache=True"][first_step] == losses["4,4 cache=True"][first_step]
    assert losses["6,2 cache=True"][4:] != losses["4,4 cache=True"][4:]


def test_removing_blocks_runs_no_extra_forward_that_a_users_stateful_hook_would_see(tmp_path):
    """Found by the fuzzer: after remove_layers vpipe redid torch's shape inference, one more forward of
    the stage, and a user's counting hook on a block that stayed saw it (the losses differed from the
    removal on). Shapes are now inferred again only where a boundary changes."""
    result = run_pattern(tmp_path, "removal_hooked")
    assert result["placements"][-1] == [[0, 1, 3, 4, 5], [6]]
    assert_trains_like_plain(result)


def test_adding_a_block_inside_a_stage_calls_the_users_loss_no_extra_time(tmp_path):
    """Found by the fuzzer's GradScaler axis: after add_layers vpipe made torch redo its first-step
    shape inference on every stage, which calls the loss once more (on the last stage), and a loss
    that counts its calls (there: to tell a step's first micro-batch) saw it. Shapes are now inferred
    again only where a new block ends a stage. The extra call showed under Interleaved 1F1B (``python
    tests/fuzz/run.py --only 74`` at commit ac34aaa, DIVERGED before the fix, refused as designed
    after it: ``--library`` this tree); this 1F1B trainer checks that a block added inside a stage
    trains as the plain copy's and leaves the loss's calls alike."""
    result = run_pattern(tmp_path, "added_counted")
    assert result["placements"][-1] == [[0, 1, 8, 2, 3, 4, 5], [6, 7]]
    assert result["loss_calls"]["vpipe"] == result["loss_calls"]["plain"] > 0
    assert_trains_like_plain(result)


def test_shape_inference_redone_after_a_block_ends_a_stage_calls_no_hook_or_loss_of_the_users(tmp_path):
    """Found by the fuzzer (seed 10418): a block appended to the last stage makes vpipe redo torch's shape
    inference on every rank, an extra forward of each stage module, and a user's counting hook on a block
    of the last stage saw it (every weight differed from the step of the edit on). The redone pass now
    runs without the user's hooks and loss, with buffers and random state put back."""
    result = run_pattern(tmp_path, "added_last_hooked")
    assert result["placements"][-1] == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    assert result["loss_calls"]["vpipe"] == result["loss_calls"]["plain"] > 0
    assert_trains_like_plain(result)


def test_the_muon_recipe_two_optimizers_a_stage_moves_each_parameter_into_its_kind(tmp_path):
    """Muon for the blocks' matrices and AdamW for the rest, given to attach as the trainer's container: moved
    weights join Muon on their new stage and moved norms and biases AdamW, state and all."""
    result = run_pattern(tmp_path, "muon")
    assert result["placements"][-1] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert moved_layers(result["log"])
    assert_trains_like_plain(result)


def test_blocks_whose_parameters_train_in_no_optimizer_given_to_attach_are_named_and_stay(tmp_path):
    result = run_pattern(tmp_path, "muon_only")
    assert all(p == [[0, 1, 2, 3, 4, 5], [6, 7]] for p in result["placements"])  # nothing moved
    off = [r for r in _events(result["log"], "moves_off") if r["stage"] == 0]
    assert off and off[0]["layers"] == [0, 1, 2, 3, 4, 5]
    assert "layer 0 has norm.weight and 3 more training in none of the optimizers given to vpipe.attach" in \
        off[0]["msg"]
    assert_trains_like_plain(result)


@pytest.mark.parametrize("scenario, found", [
    ("ema_averaged", "is averaged beside its stage (an AveragedModel of it (Net, "),
    ("ema_dict", "is averaged beside its stage (a dict of "),
])
def test_a_stage_whose_weights_are_averaged_beside_it_keeps_its_blocks_and_says_so(tmp_path, scenario, found):
    """An EMA vpipe cannot carry yet: the blocks stay (a move would freeze their average on one stage and
    crash or restart it on the other), named in one line at attach, and training matches the plain copy."""
    result = run_pattern(tmp_path, scenario)
    assert all(p == [[0, 1, 2, 3, 4, 5], [6, 7]] for p in result["placements"])
    off = {r["stage"]: r for r in _events(result["log"], "moves_off")}
    assert set(off) == {0, 1} and f"layer 0 {found}" in off[0]["msg"]
    assert_trains_like_plain(result)


@pytest.mark.parametrize("scenario", ["ema_averaged_carried", "ema_dict_carried"])
def test_an_average_named_in_carry_moves_with_its_blocks_and_ends_as_without_vpipe(tmp_path, scenario):
    """carry=[ema]: the blocks move (6,2 -> 4,4 -> 5,3 -> 3,5), each moved block's
    average travels in the move's payload, and after training both the model and
    its average equal the trainer's without vpipe, bitwise."""
    result = run_pattern(tmp_path, scenario)
    assert result["placements"][-1] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert [r["moved"] for r in _events(result["log"], "migration_done") if r["rank"] == 0] == [[[4, 5]],
                                                                                                [[4]],
                                                                                                [[3, 4]]]
    assert not _events(result["log"], "moves_off")  # a carried average pins nothing
    assert_trains_like_plain(result)
    plain, moved = result["averages"]["plain"], result["averages"]["vpipe"]
    assert plain.keys() == moved.keys() and len(plain) > 8 * 6
    for name, want in plain.items():
        assert moved[name] == want, name
    if scenario == "ema_averaged_carried":
        assert moved["n_averaged"] == 8  # steps
    # on_move heard each commit on each rank once per stage that changed, the arrived blocks in place
    rank0, rank1 = result["heard"]
    assert [(e["arrived"], e["left"], e["cause"]) for e in rank0] == [([], [4, 5], "applied"),
                                                                      ([4], [], "applied"),
                                                                      ([], [3, 4], "applied")]
    assert [(e["arrived"], e["left"]) for e in rank1] == [([4, 5], []), ([], [4]), ([3, 4], [])]
    assert all(e["in_container"] for e in rank0 + rank1)


def test_a_carry_it_cannot_take_is_refused_at_attach_in_one_line(tmp_path):
    errors = run_pattern(tmp_path, "carry_refused")["errors"]
    # on every rank
    assert errors[0].keys() == errors[1].keys() == {"other_module", "bad_keys", "unsupported"}
    # each names its own
    assert "not of this rank's stage module (Net, 14 parameters)" in errors[1]["other_module"]
    assert errors[0]["other_module"].startswith("vpipe.attach: carry[0] is an AveragedModel of another "
                                                "module (Linear, 2 parameters), not of this rank's stage "
                                                "module (Net, ")
    assert errors[0]["bad_keys"] == ("vpipe.attach: carry[0] is a dict keyed by 'decoder.weight', which "
                                     "names no parameter of this rank's stage module: a carried dict is "
                                     "keyed by the parameter names named_parameters() gives")
    assert errors[0]["unsupported"].startswith("vpipe.attach: carry[0] is a list: carry= takes torch's "
                                               "AveragedModel of the stage module or a dict of "
                                               "tensors keyed by its parameter names")
    assert all("\n" not in message for message in errors[0].values())
