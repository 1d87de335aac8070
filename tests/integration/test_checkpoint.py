"""Checkpoint and resume: atomic sharded checkpoints, verified before anything is loaded.

The runs are real (``vpipe train`` spawning gloo ranks); the corruption cases build a
checkpoint in this process with the same writer the ranks use, then damage one file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.processes import run_vpipe
from support.results import assert_optimizer_equal, assert_params_equal, load_run_optimizer, load_run_params
from vpipe.checkpoint import (
    MANIFEST,
    CheckpointError,
    check_vpipe_state,
    find_latest,
    load_checkpoint,
    restore_stage,
    save_shard,
    write_manifest,
)
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.models import build_model
from vpipe_lab.runtime.reference import optimizer_state_by_name, reference_flush

SMALL = ["--blocks", "4", "--d-model", "32", "--n-heads", "2", "--seq-len", "16", "--micro-batch-size", "2",
         "--dropout", "0", "--no-progress"]


def small_cfg(**kw) -> RunConfig:
    return RunConfig(blocks=4, d_model=32, n_heads=2, seq_len=16, micro_batch_size=2, dropout=0.0, **kw)


def train(*args: str) -> None:
    proc = run_vpipe("train", *SMALL, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------- whole runs
def test_resume_on_the_same_stages_equals_an_uninterrupted_run(tmp_path):
    # vpipe with forced moves on both sides of the checkpoint: the placement and plan epoch must resume too
    common = ["--stages", "2", "--vpipe", "--no-planning", "--moves", "2:1,5;5:4,2"]
    train(*common, "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".vpipe-lock", "step-00000003",
                                                                   "step-00000004"]
    first = load_checkpoint(tmp_path / "ck" / "step-00000003")
    assert first.step == 3 and first.placement == [[0], [1, 2, 3, 4, 5]] and first.vpipe["epoch"] == 1
    train(*common, "--steps", "8", "--resume", str(tmp_path / "ck" / "step-00000003"),
          "--out-dir", str(tmp_path / "resumed"))
    train(*common, "--steps", "8", "--out-dir", str(tmp_path / "straight"))
    assert_params_equal(load_run_params(tmp_path / "resumed", 2), load_run_params(tmp_path / "straight", 2))
    assert_optimizer_equal(load_run_optimizer(tmp_path / "resumed", 2),
                           load_run_optimizer(tmp_path / "straight", 2))
    final = [json.loads((tmp_path / "resumed" / f"rank{r}.json").read_text())["layer_ids"] for r in range(2)]
    assert final == [[0, 1, 2, 3], [4, 5]]  # the move at step 5 happened after the resume


def test_resume_two_stages_on_four_matches_the_single_process_reference(tmp_path):
    vpipe = ["--optimizer", "sgd", "--vpipe", "--no-planning"]
    train("--stages", "2", *vpipe, "--policy", "R", "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"))
    assert load_checkpoint(tmp_path / "ck").vpipe["policies"] == {str(lid): "R" for lid in range(6)}
    train("--stages", "4", *vpipe, "--steps", "6", "--resume", str(tmp_path / "ck"),
          "--out-dir", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ck4"))
    layers = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text())["layer_ids"] for r in range(4)]
    assert layers == [[0, 1], [2, 3], [4], [5]]  # re-placed: an even split over four stages
    final = load_checkpoint(tmp_path / "ck4")
    assert final.step == 6 and final.placement == layers
    # the policies came back (not --policy D)
    assert final.vpipe["policies"] == {str(lid): "R" for lid in range(6)}
    want, _, want_optim = reference_flush(small_cfg(stages=2, steps=6, optimizer="sgd"))
    assert_params_equal(load_run_params(tmp_path / "out", 4), want)
    assert_optimizer_equal(load_run_optimizer(tmp_path / "out", 4), want_optim)


def test_resume_refuses_a_damaged_checkpoint_before_starting_any_rank(tmp_path):
    root = write_checkpoint(tmp_path)
    shard = next(root.glob("rank1-*.pt"))
    shard.write_bytes(shard.read_bytes()[:-10])
    proc = run_vpipe("train", *SMALL, "--stages", "2", "--steps", "4", "--resume", str(tmp_path / "ck"),
                     timeout=60)
    assert proc.returncode == 2
    assert f"vpipe: error: checkpoint shard {shard} is truncated or padded" in proc.stderr
    assert "rank 0" not in proc.stderr  # refused by the launcher


# ---------------------------------------------------------------------- the files, in this process
def two_stage_model(seed: int = 0) -> tuple[list[torch.nn.Sequential], list[torch.optim.Optimizer]]:
    """The small model as two stage modules with Adam, after one step (so every state tensor exists)."""
    cfg = small_cfg(stages=2, seed=seed)
    spec = cfg.model_spec()
    model = build_model(spec, seed=seed)
    stages, optims = [], []
    for ids in cfg.stage_layer_ids():
        stage = torch.nn.Sequential()
        for lid in ids:
            stage.add_module(str(lid), model.get_submodule(str(lid)))
        stages.append(stage)
        optims.append(torch.optim.Adam(stage.parameters(), lr=1e-3))
    x, y = spec.batch(seed, 4, seed)
    spec.loss_fn()(model(x), y).backward()
    for opt in optims:
        opt.step()
    return stages, optims


def write_checkpoint(tmp_path: Path, step: int = 7) -> Path:
    stages, optims = two_stage_model()
    step_dir = tmp_path / "ck" / f"step-{step:08d}"
    shards = [save_shard(step_dir, r, stages[r], optims[r], {}) for r in range(2)]
    placement = [[int(n) for n in s._modules] for s in stages]
    write_manifest(step_dir, step, shards, {"version": 1, "epoch": 2, "iteration": step, "stages": placement,
                                            "policies": {"1": "R"}, "next_layer_id": 6})
    return step_dir


def snapshot(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    return ({k: v.clone() for k, v in module.state_dict().items()},
            optimizer_state_by_name(dict(module.named_parameters()), [optimizer]))


def test_a_checkpoint_restores_parameters_and_optimizer_state_by_layer_name(tmp_path):
    step_dir = write_checkpoint(tmp_path)
    ckpt = load_checkpoint(tmp_path / "ck")  # the root: the newest complete checkpoint under it
    assert (ckpt.path, ckpt.step, ckpt.placement) == (step_dir, 7, [[0, 1, 2], [3, 4, 5]])
    assert ckpt.vpipe["policies"] == {"1": "R"} and ckpt.vpipe["epoch"] == 2
    saved_stages, saved_optims = two_stage_model()
    # restore on another placement: one stage holding every layer, a fresh optimizer
    fresh = torch.nn.Sequential()
    for name, layer in build_model(small_cfg().model_spec(), seed=5)._modules.items():
        fresh.add_module(name, layer)
    opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    restore_stage(ckpt, fresh, opt)
    want_params = {k: v for s in saved_stages for k, v in s.state_dict().items()}
    want_optim = {}
    for s, o in zip(saved_stages, saved_optims):
        want_optim.update(optimizer_state_by_name(dict(s.named_parameters()), [o]))
    got_params, got_optim = snapshot(fresh, opt)
    assert_params_equal(got_params, want_params)
    assert_optimizer_equal(got_optim, want_optim)


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("target, damage, message", [
    ("rank1-*.pt", damage_truncate, "checkpoint shard {} is truncated or padded: "),
    ("rank0-*.pt", damage_flip, "checkpoint shard {} is corrupted: sha256 "),
    ("rank1-*.pt", lambda p: p.unlink(), "checkpoint shard {} is missing"),
    (MANIFEST, damage_truncate, "checkpoint manifest {} is not valid JSON (truncated or corrupted)"),
    (MANIFEST, lambda p: p.write_text(p.read_text().replace('"epoch": 2', '"epoch": 3')),
     "checkpoint manifest {} is corrupted: its sha256 does not match its contents"),
    (MANIFEST, lambda p: p.write_text(p.read_text().replace('"version": 1,\n "vpipe"',
                                                            '"version": 9,\n "vpipe"')),
     "checkpoint manifest {} has format version 9; this vpipe reads version 1"),
], ids=["truncated-shard", "flipped-byte", "missing-shard", "truncated-manifest", "edited-manifest",
        "version"])
def test_damage_is_named_and_leaves_the_model_untouched(tmp_path, target, damage, message):
    step_dir = write_checkpoint(tmp_path)
    victim = next(step_dir.glob(target))
    damage(victim)
    stages, optims = two_stage_model(seed=3)  # a different model: loading anything would change it
    before = snapshot(stages[0], optims[0])
    with pytest.raises(CheckpointError) as err:
        restore_stage(load_checkpoint(step_dir), stages[0], optims[0])
    assert str(err.value).startswith(message.format(victim)), str(err.value)
    after = snapshot(stages[0], optims[0])
    assert_params_equal(after[0], before[0])
    assert_optimizer_equal(after[1], before[1])


def test_a_model_of_another_shape_is_refused_before_loading(tmp_path):
    step_dir = write_checkpoint(tmp_path)
    cfg = RunConfig(blocks=4, d_model=64, n_heads=2, seq_len=16, dropout=0.0)
    model = build_model(cfg.model_spec(), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError,
                       match=r"0\.pos is \(16, 32\) torch.float32 there, \(16, 64\) "
                             r"torch.float32 in this model"):
        restore_stage(load_checkpoint(step_dir), model, None)
    assert_params_equal(model.state_dict(), before)


def test_an_unsealed_checkpoint_is_never_picked(tmp_path):
    write_checkpoint(tmp_path, step=3)
    newer = write_checkpoint(tmp_path, step=6)
    (newer / MANIFEST).unlink()  # a crash between the shards and the manifest
    assert find_latest(tmp_path / "ck") == tmp_path / "ck" / "step-00000003"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint .* in .*empty"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="checkpoint directory .*absent does not exist"):
        load_checkpoint(tmp_path / "absent")


@pytest.mark.parametrize("change, message", [
    ({"version": 2}, "has version 2; this vpipe reads version 1"),
    ({"epoch": -1}, "epoch must be a non-negative integer, got -1"),
    ({"stages": [[0, 1], [1, 2]]}, "layer 1 is placed twice"),
    ({"stages": [[0], []]}, "stage 1 of the plan has no layers"),
    ({"policies": {"0": "X"}}, "unknown policy 'X'"),
    ({"policies": {"9": "S"}}, "policies name layers the plan does not place: [9]"),
    ({"next_layer_id": 2}, "next_layer_id 2 is not above the largest layer id 2"),
])
def test_vpipe_state_is_validated(change, message):
    state = {"version": 1, "epoch": 4, "iteration": 10, "stages": [[0], [1, 2]], "policies": {},
             "next_layer_id": 3}
    assert check_vpipe_state(dict(state)) == state
    with pytest.raises(CheckpointError) as err:
        check_vpipe_state({**state, **change})
    assert message in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--checkpoint-every", "3"], "checkpoint_every needs checkpoint_dir"),
    (["--checkpoint-dir", "x", "--checkpoint-every", "-1"],
     "checkpoint_every must be an integer >= 0, got -1"),
    (["--checkpoint-dir", "x", "--schedule", "pipedream"], "checkpoints need a flush schedule"),
])
def test_checkpoint_options_are_validated_before_any_rank_starts(args, message):
    proc = run_vpipe("train", "--stages", "2", *args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_resume_keeps_adamw_its_weight_decay_and_a_warmup_cosine_schedule_on_the_same_and_other_stages(
    tmp_path,
):
    """The whole training state comes back: learning rates mid-schedule, weight decay, moments, RNG."""
    common = ["--optimizer", "adamw", "--weight-decay", "0.1", "--lr-schedule", "warmup-cosine",
              "--warmup-steps", "3", "--lr", "0.01", "--steps", "8"]
    train("--stages", "2", *common, "--out-dir", str(tmp_path / "straight"))
    train("--stages", "2", *common, "--steps", "8", "--checkpoint-dir", str(tmp_path / "ck"),
          "--checkpoint-every",
          "4")
    saved = load_checkpoint(tmp_path / "ck" / "step-00000004")
    state = saved.load_shards()
    assert {g["weight_decay"] for g in state["groups"].values()} == {0.1}
    # rng only when a rank asks for its own
    assert state["scheduler"]["last_epoch"] == 4 and state["rng"] is None
    for stages in ("2", "4"):
        out = tmp_path / f"resumed{stages}"
        train("--stages", stages, *common, "--resume", str(tmp_path / "ck" / "step-00000004"), "--out-dir",
              str(out))
        assert_params_equal(load_run_params(out, int(stages)), load_run_params(tmp_path / "straight", 2))
        assert_optimizer_equal(load_run_optimizer(out, int(stages)),
                               load_run_optimizer(tmp_path / "straight", 2))
        lrs = {lr for r in range(int(stages))
               for lr in json.loads((out / f"rank{r}.json").read_text())["lrs"]}
        want = {lr for r in range(2)
                for lr in json.loads((tmp_path / "straight" / f"rank{r}.json").read_text())["lrs"]}
        assert lrs == want and len(want) == 1  # bitwise the uninterrupted run's rate after step 8
    want, _, _ = reference_flush(small_cfg(stages=2, steps=8, optimizer="adamw", weight_decay=0.1,
                                           lr_schedule="warmup-cosine", warmup_steps=3, lr=0.01))
    assert_params_equal(load_run_params(tmp_path / "straight", 2), want)


def test_a_resume_without_the_schedulers_state_would_train_at_the_wrong_rate(tmp_path):
    """What the test above guards against: a fresh scheduler restarts the warm-up."""
    from vpipe_lab.runtime.optim import make_optimizer, make_scheduler

    cfg = small_cfg(optimizer="adamw", lr_schedule="warmup-cosine", warmup_steps=3, lr=0.01, steps=8)
    model = build_model(cfg.model_spec(), seed=0)
    opt = make_optimizer(cfg, model.parameters())
    sched = make_scheduler(cfg, opt)
    for _ in range(4):
        opt.step()
        sched.step()
    fresh = make_scheduler(cfg, make_optimizer(cfg, model.parameters()))
    assert fresh.get_last_lr() != sched.get_last_lr()


def test_param_group_hyperparameters_come_back_by_parameter_name_and_a_conflict_is_refused(tmp_path):
    stages, optims = two_stage_model()
    for opt, lr in zip(optims, (0.005, 0.007)):  # e.g. a schedule's current rate, a weight decay set by hand
        opt.param_groups[0].update(lr=lr, weight_decay=0.2, betas=(0.8, 0.9))
    step_dir = tmp_path / "ck" / "step-00000001"
    shards = [save_shard(step_dir, r, stages[r], optims[r], {}) for r in range(2)]
    write_manifest(step_dir, 1, shards, {"version": 1, "epoch": 0, "iteration": 1,
                                         "stages": [[int(n) for n in s._modules] for s in stages],
                                         "policies": {},
                                         "next_layer_id": 6})
    ckpt = load_checkpoint(step_dir)
    fresh, _ = two_stage_model(seed=1)
    opt = torch.optim.Adam(fresh[1].parameters(), lr=1e-3)
    restore_stage(ckpt, fresh[1], opt)
    assert opt.param_groups[0]["lr"] == 0.007 and opt.param_groups[0]["weight_decay"] == 0.2
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    # one stage holding layers that were saved with different learning rates cannot take both
    whole = torch.nn.Sequential()
    for stage in two_stage_model(seed=2)[0]:
        for name, layer in stage._modules.items():
            whole.add_module(name, layer)
    mixed = torch.optim.Adam(whole.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in whole.parameters()]
    with pytest.raises(CheckpointError, match="group 0 had different hyperparameters"):
        restore_stage(ckpt, whole, mixed)
    # refused before touching anything
    assert all(torch.equal(a, b) for a, b in zip(before, whole.parameters()))
    assert mixed.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("target", ["rank1-*.pt", MANIFEST])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_reading(tmp_path, target):
    import os

    step_dir = write_checkpoint(tmp_path)
    victim = next(step_dir.glob(target))
    victim.unlink()
    os.mkfifo(victim)  # reading it would block forever
    what = "checkpoint manifest" if target == MANIFEST else "checkpoint shard"
    with pytest.raises(CheckpointError, match=f"{what} .* is not a regular file"):
        load_checkpoint(step_dir)


def test_ranks_hash_only_the_shards_they_load(tmp_path):
    step_dir = write_checkpoint(tmp_path)
    damage_flip(next(step_dir.glob("rank1-*.pt")))  # same size, other bytes
    ckpt = load_checkpoint(step_dir, verify="stat")  # what a rank does: type and size only
    ckpt.load_shards([0, 1, 2])  # rank 0's layers: its own shard, intact
    with pytest.raises(CheckpointError, match="is corrupted: sha256"):
        ckpt.load_shards([3])
    with pytest.raises(CheckpointError, match="is corrupted: sha256"):
        load_checkpoint(step_dir)  # the launcher checks them all


def test_resume_problems_are_named_at_launch_in_one_line(tmp_path):
    train("--stages", "2", "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every",
          "2")
    (tmp_path / "ck" / "step-00000004" / MANIFEST).unlink()  # the newest is incomplete now
    older = run_vpipe("train", *SMALL, "--stages", "2", "--steps", "5", "--resume", str(tmp_path / "ck"))
    assert older.returncode == 0, older.stderr[-2000:]
    assert (f"vpipe: {tmp_path / 'ck' / 'step-00000004'} has no manifest.json (unfinished "
            "or damaged); resuming from step-00000002") in older.stderr
    for args, message in (
        (["--d-model", "48"], "was saved with d_model 32; this run has 48"),
        (["--optimizer", "sgd"], "was saved with optimizer 'adam'; this run has 'sgd'"),
    ):
        proc = run_vpipe("train", *SMALL, *args, "--stages", "2", "--steps", "5", "--resume",
                         str(tmp_path / "ck"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith("vpipe: error: checkpoint ")
        assert proc.stderr.strip().endswith(message)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_vpipe("train", *SMALL, "--steps", "2", "--checkpoint-dir", str(blocker / "ck"))
    assert proc.returncode == 2 and proc.stderr.strip() == (f"vpipe: error: checkpoint_dir {blocker / 'ck'}: "
                                                            f"{blocker} is a file, not a directory")
