"""The trainers people write attach with one line: Sequential slices,
the tutorial/torchtitan shape, Hugging Face.

Each trainer in examples/ is run twice, without and with
``vpipe.attach(schedule, optimizer=opt)`` (the only difference), from an uneven split; the
losses must match, blocks must have moved, and every rank's own ``state_dict()`` must load
into the same trainer's model built fresh for the final partition. One case runs under
torchrun itself; the others get the environment and store torchrun gives its ranks from the
lab's spawner, forked with torch already imported (``run_ranks``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.processes import ROOT, child_env, run_ranks, run_worker
from vpipe.log import read_log

# With the defaults the planner proposes from the sample of step 3, confirms it with step
# 5's and the move applies a few steps later (step 9 on a quiet machine); 50 steps leave
# room for a planner that runs late because the machine is busy (it plans at a low
# priority), and for the later moves a slower stage may ask for.
STEPS = 50
TORCHRUN_CASE = ("train_tutorial", 2, "6,2", "1f1b")  # (script, ranks, partition, schedule) run by torchrun


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shape_run(tmp_path_factory):
    """Runs of an example trainer, each made once for the module's tests that compare it."""
    runs: dict[tuple, tuple[dict, list[dict], list[dict]]] = {}

    def train(script: str, ranks: int, partition: str, schedule: str, vpipe: bool):
        key = (script, ranks, partition, schedule, vpipe)
        if key not in runs:
            runs[key] = _train(tmp_path_factory, script, ranks, partition, schedule, vpipe)
        return runs[key]

    return train


def _train(tmp_path_factory, script: str, ranks: int, partition: str, schedule: str, vpipe: bool):
    """Losses, vpipe's log records and each rank's saved state_dict of one run."""
    tmp = tmp_path_factory.mktemp(script)
    out, log_file, output = tmp / "run.json", tmp / "vpipe.log", tmp / "output.txt"
    trainer = [str(ROOT / "examples" / f"{script}.py"), "--steps", str(STEPS), "--partition", partition,
               "--schedule", schedule, "--out", str(out), *(["--vpipe"] if vpipe else [])]
    env = child_env(VPIPE_LOG_FILE=str(log_file))
    if (script, ranks, partition, schedule) == TORCHRUN_CASE:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node",
                               str(ranks), *trainer], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        run_ranks(trainer, ranks, output, env)
    states = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(ranks)]
    return json.loads(out.read_text()), read_log(log_file) if log_file.exists() else [], states


def _final_counts(log: list[dict], ranks: int, partition: str) -> list[int]:
    counts = [int(c) for c in partition.split(",")]
    for record in log:
        if record.get("event") == "plan_applied":
            counts[record["stage"]] = len(record["layers"])
    assert sum(counts) == sum(int(c) for c in partition.split(","))
    return counts


def _assert_close_losses(got: list[list[float]], want: list[list[float]], rtol: float) -> None:
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a, b):
            assert abs(x - y) <= rtol * abs(y), f"step {step}: {x} vs {y}"


def _fresh_stage(script: str, rank: int, counts: list[int]) -> torch.nn.Module:
    """The example's own stage module for ``rank``, built fresh for the partition ``counts``."""
    ex = _load_example(script)
    first = sum(counts[:rank])
    if script == "train_tutorial":
        torch.manual_seed(0)
        return ex.split_model(ex.Transformer(ex.ModelArgs(n_layers=sum(counts))), rank, counts)
    if script == "train_hf_gpt2":
        model = ex.make_model(sum(counts), 64, 256, 32)
        return ex.GPT2Stage(model, first, first + counts[rank], rank == 0, rank == len(counts) - 1)
    layers = [ex.ResidualMLP(64) for _ in range(sum(counts))]
    return torch.nn.Sequential(*layers[first:first + counts[rank]])


CASES = [
    ("train_tutorial", 2, "6,2", "gpipe"),
    ("train_tutorial", 2, "6,2", "1f1b"),
    # 4 ranks on 2 cores: CI's slow run
    pytest.param("train_tutorial", 4, "5,1,1,1", "1f1b", marks=pytest.mark.slow),
    ("train_sequential", 2, "6,2", "1f1b"),
    ("train_sequential", 4, "5,1,1,1", "gpipe"),
    ("train_hf_gpt2", 2, "6,2", "gpipe"),
    pytest.param("train_hf_gpt2", 4, "5,1,1,1", "1f1b", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("script, ranks, partition, schedule", CASES)
def test_one_line_rebalances_the_trainer_and_keeps_its_losses(shape_run, script, ranks, partition, schedule):
    if script == "train_hf_gpt2":
        pytest.importorskip("transformers")
    plain, _, _ = shape_run(script, ranks, partition, schedule, vpipe=False)
    with_vpipe, log, states = shape_run(script, ranks, partition, schedule, vpipe=True)
    moved = [r for r in log if r.get("event") == "migration_done" and r["moved"]]
    assert moved, f"the planner should have rebalanced the {partition} split within {STEPS} steps"
    counts = _final_counts(log, ranks, partition)
    # ranks sharing CI's 2 cores may measure the balanced split slower: then the judge puts the old one back
    reverted = [r for r in log if r.get("event") == "plan_reverted"]
    assert counts != [int(c) for c in partition.split(",")] or reverted
    _assert_close_losses(with_vpipe["losses"], plain["losses"], rtol=1e-6)
    for rank, state in enumerate(states):  # the user's own checkpoint loads into the final partition's model
        fresh = _fresh_stage(script, rank, counts)
        fresh.load_state_dict(state, strict=True)
    if script == "train_hf_gpt2":
        first_last = sum(counts[:-1])
        # layer_idx travelled
        assert with_vpipe["layer_idx"] == list(range(first_last, first_last + counts[-1]))


@pytest.mark.parametrize("script", ["train_tutorial", "train_sequential", "train_hf_gpt2"])
def test_a_balanced_trainer_with_vpipe_trains_bitwise_like_without(shape_run, script):
    if script == "train_hf_gpt2":
        pytest.importorskip("transformers")
    plain, _, plain_states = shape_run(script, 2, "4,4", "1f1b", vpipe=False)
    with_vpipe, log, states = shape_run(script, 2, "4,4", "1f1b", vpipe=True)
    assert not [r for r in log if r.get("event") == "migration_start"]
    assert {r["rank"] for r in log if r.get("event") == "attached"} == {0, 1}
    assert with_vpipe["losses"] == plain["losses"]  # bitwise, every micro-batch of every step
    for got, want in zip(states, plain_states):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_tutorial_model_trains_to_the_same_parameters_after_moves(shape_run):
    """The tutorial's ModuleDict keeps global keys, so all ranks' states merge into one model's."""
    _, _, plain = shape_run("train_tutorial", 2, "6,2", "1f1b", vpipe=False)
    _, log, moved = shape_run("train_tutorial", 2, "6,2", "1f1b", vpipe=True)
    merged_plain = {k: v for state in plain for k, v in state.items()}
    merged_moved = {k: v for state in moved for k, v in state.items()}
    assert merged_plain.keys() == merged_moved.keys()
    epochs = {r["epoch"] for r in log if r.get("event") == "migration_done" and r["moved"]}
    assert epochs  # moved; the final split may be the first again only after a move back (2 shared cores)
    assert {k for k in moved[1] if k.startswith("layers.")} != {k for k in plain[1]
                                                                if k.startswith("layers.")} \
        or len(epochs) >= 2
    for name, want in merged_plain.items():
        assert torch.allclose(merged_moved[name], want, rtol=1e-5, atol=1e-7), name


# ---------------------------------------------------------------------- set-ups that attach refuses or limits
def _scenario(tmp_path: Path, name: str, ranks: int) -> dict:
    return run_worker(tmp_path, "shape_worker", name, ranks)


def test_shapes_attach_cannot_use_get_one_error_that_says_what_was_found_and_what_to_pass(tmp_path):
    result = _scenario(tmp_path, "refusals", 1)
    assert result["no_container"].startswith("BlockContainerError: stage 0: vpipe.attach found no container "
                                             "of repeated blocks in the stage module (Flat)")
    assert "layers='path.to.container'" in result["no_container"]
    assert "layers='blocks': the stage module (Transformer) has no submodule 'blocks'" in result["bad_path"]
    assert result["ddp"].startswith("TypeError: vpipe.attach does not support a stage module wrapped in "
                                    "DistributedDataParallel")
    assert result["tutorial_ok"] == "no error"


def test_pipelines_inside_a_mesh_that_are_not_replicas_are_refused_before_anything_is_installed(tmp_path):
    result = _scenario(tmp_path, "subgroup", 2)
    assert result["error"].startswith("ValueError: vpipe.attach on stage 0: world rank(s) [1] "
                                      "run another pipeline ")
    assert result["error"].endswith("every data-parallel replica must run the same "
                                    "stages, schedule and blocks")
    assert not [r for r in result["log"] if r.get("event") == "attached"]
    assert result["swapped"] == ("ValueError: vpipe.attach: stage 1 runs on rank 0 of its pipeline's process "
                                 "group; vpipe needs stage i on group rank i (as torch's "
                                 "single-stage schedules do)")


def test_a_traced_split_gets_recompute_but_no_moves_and_says_so_once(tmp_path):
    result = _scenario(tmp_path, "traced", 2)
    assert result["vpipe"] == result["plain"]  # recompute keeps the losses bitwise
    info = result["info"]
    assert info[0]["layers"] == [0, 1, 2, 3, 4, 5] and info[1]["layers"] == [6, 7]  # nothing moved
    assert all(i["recomputes"] > 0 for i in info)  # the layers inside the GraphModule ran under recompute
    off = [r for r in result["log"] if r.get("event") == "moves_off"]
    assert sorted(r["stage"] for r in off) == [0, 1] and "traced GraphModule" in off[0]["msg"]
    assert not [r for r in result["log"] if r.get("event") == "migration_start"]
    plans = [r for r in result["log"] if r.get("event") == "plan"]
    # the planner proposes policies only
    assert plans and all(p["new_stages"] == p["old_stages"] for p in plans)
    # with no memory budget, recomputing only costs time: the plan puts every layer back to keep
    changed = {lid: policy for p in plans for lid, policy in p["policies_changed"].items()}
    assert changed == {str(i): "D" for i in range(8)}
    assert all(set(i["policies"].values()) == {"D"} for i in info)


def test_layers_are_added_and_removed_in_the_tutorial_module_dict(tmp_path):
    ranks = _scenario(tmp_path, "nas", 2)["ranks"]
    first, second = ranks
    assert first["new_ids"] == [8] and second["new_ids"] == [8]
    assert first["keys"] == [["0", "1", "8", "2", "3"], ["0", "8", "2", "3"]]
    assert second["keys"] == [["4", "5", "6", "7"], ["4", "5", "7"]]
    assert first["new_layer_trained"]  # the user's forward runs the new block and the optimizer updates it
    assert all(r["optimizer_params"] == r["module_params"] for r in ranks)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in second["losses"])


def test_under_a_roomy_budget_the_tutorial_trainer_runs_its_blocks_without_hooks_and_trains_bitwise(tmp_path):
    ranks = _scenario(tmp_path, "budget", 2)["ranks"]
    last = ranks[1]
    assert last["losses"]["vpipe"] == last["losses"]["plain"] and len(last["losses"]["plain"]) == 24 * 4
    for r in ranks:
        # hooks on the first step (nothing measured yet) and on the sampled, metered ones (steps 1 and 13: the
        # base rate samples every second step, every fifth sample meters); none after
        assert r["hooked_steps"] and max(r["hooked_steps"]) <= 13, r["hooked_steps"]
        # nor any call into the tensor manager: its stage runs torch's own methods (the first step measures,
        # the sampled, metered steps 1 and 13 measure again)
        assert r["called_steps"] == [0, 1, 13], r["called_steps"]
        # (the rank's budget less its weights and optimizer state)
        assert 0 < r["peak"] <= r["budget"] < 1 << 30
        # the one line's defaults: every 2nd step, backing off to every 80th
        assert r["max_sample_every"] == 80


def test_the_tutorial_trainer_swapping_every_block_skips_the_copies_that_would_come_straight_back(tmp_path):
    """From the second step on (the first learns the schedule's order): 1F1B's last stage
    runs each micro-batch's backward right after its forward, so it copies nothing; under
    GPipe with a budget each rank keeps on the device what the budget has room for and copies
    the rest. Losses bitwise as without vpipe throughout."""
    first, last = _scenario(tmp_path, "swaps_skipped", 2)["ranks"]
    for case in ("1f1b", "gpipe"):
        assert last[case]["losses"]["vpipe"] == last[case]["losses"]["plain"], case
        assert len(last[case]["losses"]["plain"]) == 6 * 4
        for r in (first, last):
            assert r[case]["policies"] == ["S"] and r[case]["sync_fallbacks"] == 0, (case, r[case])
    assert first["1f1b"]["copied"] == [first["1f1b"]["copied"][0]] * 6 and first["1f1b"]["copied"][0] > 0
    assert last["1f1b"]["copied"][0] > 0 and last["1f1b"]["copied"][1:] == [0] * 5, last["1f1b"]["copied"]
    for r in (first, last):
        copied = r["gpipe"]["copied"]
        assert 0 < copied[1] < copied[0] and copied[1:] == [copied[1]] * 5, copied
        assert 0 < r["gpipe"]["peak"] <= r["gpipe"]["budget"], r["gpipe"]


def test_a_step_whose_inputs_change_shape_under_a_budget_calls_the_manager_for_every_micro_batch(tmp_path):
    """Quiet steps run the stage's own methods; a step with new input shapes goes through vpipe's wrappers,
    which measure the new shapes, and the next steps of those shapes run without them again."""
    result = _scenario(tmp_path, "new_shapes", 1)
    assert result["losses"]["vpipe"] == result["losses"]["plain"] and len(result["losses"]["plain"]) == 15 * 4
    calls, seq_lens, metering = result["calls"], result["seq_lens"], result["metering"]
    assert seq_lens[5:11] == [32, 16, 16, 16, 16, 32]
    assert calls[0] >= 4, calls  # the first step: each micro-batch's forward, measured
    assert [step for step, on in enumerate(metering) if on] == [1, 13]  # the monitor's metered samples
    for step in range(1, 15):
        measured = seq_lens[step] != seq_lens[step - 1] or metering[step]
        assert (calls[step] >= 4 if measured else calls[step] == 0), (step, calls)
    assert result["hooked"] is False
    # the manager measured each new shape: the micro-batches of step 6
    # and of step 10 (2 sequences of 16 or 32)
    assert result["input_shapes"][6] == [[2, 16]] and result["input_shapes"][10] == [[2, 32]]


def test_pipedream_runs_its_quiet_steps_without_the_manager_and_counts_what_stays_in_flight(tmp_path):
    """PipeDream's micro-batches stay in flight across steps: a step that runs the stage's own methods leaves
    none counted, and the next step that calls the manager counts those its forwards left in flight."""
    ranks = _scenario(tmp_path, "pipedream_budget", 2)["ranks"]
    assert (
        ranks[1]["losses"]["vpipe"] == ranks[1]["losses"]["plain"]
        and len(ranks[1]["losses"]["plain"]) == 24 * 4
    )
    first, last = ranks
    # the first step and the metered samples (1, 13) call the manager; on the first stage so does the step
    # after each, whose backwards release what the sample's forwards saved through the hooks
    assert first["called_steps"] == [0, 1, 2, 13, 14] and last["called_steps"] == [0, 1, 13]
    for r in ranks:
        assert r["same_weights"], r["rank"]
        for step, resident in enumerate(r["resident"]):
            if step not in r["called_steps"]:
                assert resident == 0, (step, r)  # nothing counted while the manager is not called
        assert r["after_flush"] == 0 and r["counted_after_flush"] == 0
    assert first["in_flight"][12] > 0 and first["in_flight"][14] > 0  # in flight between steps
    # step 13 calls the manager again: the micro-batches in flight since the plain steps are counted first
    assert first["at_first_forward"]["13"] == first["in_flight"][12] * first["per_mb"]
    # step 14's quiet forwards leave theirs counted when the stage goes plain again, and forgotten at step 15
    assert first["resident"][14] == first["in_flight"][14] * first["per_mb"] and first["resident"][15] == 0


def test_the_tutorial_model_on_interleaved_1f1b_keeps_every_block_where_the_ranks_real_peak_fits(tmp_path):
    """Each rank runs two stages that never peak together: a budget between the
    rank's real peak with every block kept and its stages' own peaks added up holds
    the plain schedule, and vpipe keeps every block too."""
    ranks = _scenario(tmp_path, "budget_interleaved", 2)["ranks"]
    last = ranks[1]
    assert last["losses"]["vpipe"] == last["losses"]["plain"] and len(last["losses"]["plain"]) == 16 * 4
    deciding = ranks[ranks[0]["decided_by"]]
    room = deciding["budget"] - deciding["fixed"]
    assert max(deciding["rank_peak"], deciding["counted_peak"]) <= room < deciding["own_peaks"]
    for r in ranks:
        assert all(set(p.values()) == {"D"} for p in r["policies"]), r
        assert r["hooked"] == [False, False]  # kept and fitting: the blocks run as without vpipe
        for steps in r["called_steps"]:  # and, past the metered samples (to step 13), torch's own methods run
            assert steps and not [s for s in steps if s > 13], r["called_steps"]
    assert any(n for r in ranks for n in r["escalations"])  # the first step, on equal halves, had to swap


def test_attach_detach_attach_with_plans_in_both_does_not_hang_and_leaves_no_keys(tmp_path):
    ranks = _scenario(tmp_path, "reattach", 2)["ranks"]
    for r in ranks:
        assert r["epochs"][0] >= 1 and r["epochs"][1] >= 1  # plans were applied in both attaches
        assert r["leftover"] == []  # detach removed this rank's keys
    assert ranks[0]["layers"] == ["0", "1", "2", "3"]  # rebalanced in the first attach, kept in the second


def test_misuse_gets_a_clear_error_on_every_rank_instead_of_a_hang_or_an_abort(tmp_path):
    first, second = _scenario(tmp_path, "misuse", 2)["ranks"]
    for r in (first, second):
        assert r["foreign_optimizer"].startswith("ValueError: vpipe.attach: the optimizer holds none of this "
                                                 "stage's")
        assert "made another layer edit at this point" in r["different_edits"]
        assert "remove_layers must be called between steps (after optimizer.step()), not inside one" in \
            r["edit_in_forward"]
    assert first["layers_after"] == ["0", "1", "2", "3"] and second["layers_after"] == ["4", "5", "6", "7"]
    assert first["one_rank_edit"] == ("RuntimeError: remove_layers on stage 0: stage(s) [1] did not make the "
                                      "same call within 3 s; every rank must call it, at the same step")
    assert first["one_rank_attach"] == ("RuntimeError: vpipe.attach on stage 0: stage(s) [1] did not make "
                                        "the same call within 3 s; every rank must call it, at the same step")
