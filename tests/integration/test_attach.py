"""The one line: an unchanged torch.distributed.pipelining script trains the same with vpipe under it."""

from __future__ import annotations

import json

import pytest

from support.processes import ROOT, WORKERS, child_env, run_ranks
from vpipe.log import read_log


def _example(tmp_path, name: str, *extra: str, width: int = 192, script: str = "train_1f1b.py",
             ranks: int = 4) -> tuple[dict, list[dict]]:
    out, log_file = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    run_ranks([str(ROOT / "examples" / script), "--steps", "20", "--out", str(out), "--log-file",
               str(log_file),
               *extra], ranks, tmp_path / f"{name}.txt", child_env(EXAMPLE_WIDTH=str(width)))
    return json.loads(out.read_text()), (read_log(log_file) if log_file.exists() else [])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _example(tmp_path_factory.mktemp("plain"), "plain")[0]


def test_one_line_with_planning_off_changes_nothing(plain, tmp_path):
    with_vpipe, log = _example(tmp_path, "vpipe", "--vpipe", "--no-planning")
    assert with_vpipe["losses"] == plain["losses"]  # bitwise, every micro-batch of every step
    assert with_vpipe["layers"] == plain["layers"]
    assert {r["rank"] for r in log if r.get("event") == "attached"} == {0, 1, 2, 3}


def test_one_line_with_live_rebalancing_keeps_the_losses(plain, tmp_path):
    with_vpipe, log = _example(tmp_path, "vpipe", "--vpipe")
    moved = [r for r in log if r.get("event") == "migration_done" and r["moved"]]
    assert moved, "the planner should have rebalanced the 6,2,2,2 partition within 20 steps"
    first = {r["rank"]: r["layers"] for r in log if r.get("event") == "attached"}
    last = {r["rank"]: r["layers"] for r in log if r.get("event") == "plan_applied"}
    assert last and any(last[rank] != first[rank] for rank in last)  # layers really changed stage
    for got, want in zip(with_vpipe["losses"], plain["losses"]):
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-6 * abs(b)
    plans = [r for r in log if r.get("event") == "plan"]
    assert plans and all(k in plans[0] for k in ("old_stages", "new_stages", "predicted_step_s_before",
                                                 "predicted_step_s_after", "planner_s", "policies_changed"))


def test_hand_written_loop_gets_the_same_losses_with_moves_and_recompute(tmp_path):
    """``vpipe.attach(module, optimizer=...)`` under a send/recv
    GPipe loop: the optimizer step is the boundary."""
    run = {"script": "train_handwritten.py", "ranks": 2}
    plain, _ = _example(tmp_path, "plain", **run)
    recompute, _ = _example(tmp_path, "recompute", "--vpipe", "--no-planning", "--policy", "R", **run)
    assert recompute["losses"] == plain["losses"]  # bitwise: recompute changes where activations live only
    planned, log = _example(tmp_path, "planned", "--vpipe", **run)
    moved = [r for r in log if r.get("event") == "migration_done" and r["moved"]]
    assert moved, "the 6,2 partition should have been rebalanced"
    # moved, then back (the judge or the planner, on 2 shared cores)
    back = len({r["epoch"] for r in moved}) >= 2
    assert planned["layers"] != plain["layers"] or back
    for got, want in zip(planned["losses"], plain["losses"]):
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-6 * abs(b)


def test_detach_restores_the_trainer_exactly(tmp_path):
    out = tmp_path / "snap.json"
    run_ranks([str(WORKERS / "attach_worker.py"), str(out)], 1, tmp_path / "snap.txt")
    snap = json.loads(out.read_text())
    assert snap["after"] == snap["before"]
    assert snap["during"] != snap["before"]  # it did install something
    assert snap["during"]["hooks"]["1"][3]  # layer 1 ran under recompute (its forward was wrapped)


def test_config_defaults():
    import torch

    from vpipe._attach import VpipeConfig, resolve_memory_budget

    config = VpipeConfig()
    assert config.memory_budget == "auto" and config.planning
    assert resolve_memory_budget("auto", torch.device("cpu")) is None  # a CPU stage has no device limit
    assert resolve_memory_budget(123, torch.device("cpu")) == 123  # bad values: tests/unit/test_bad_input.py


def _hand_written_pipeline():
    import torch
    from torch import nn

    from vpipe.stage.pipeline import LocalStage, Pipeline

    return Pipeline(None, [LocalStage(1, nn.Linear(2, 2))], 2, (0, 1), "gpipe", torch.device("cpu"))


def test_the_planner_is_configured_with_the_pipelines_shape_and_the_users_options():
    from vpipe import VpipeConfig
    from vpipe.planner.online import OnlineConfig
    from vpipe.rank.resolved import planner_config

    config = VpipeConfig(micro_batches=4, planner_options={"confirm_samples": 1})
    sent = planner_config(config, _hand_written_pipeline(), 1 << 30, allow_moves=False)
    assert OnlineConfig.from_mapping(sent) == OnlineConfig(schedule="gpipe", micro_batches=4,
                                                           memory_budget=1 << 30,
                                                           allow_moves=False, confirm_samples=1)
    # another planner gets the user's options as they are, or nothing
    mine = VpipeConfig(planner="mypkg.plans:rebalance", planner_options={"threshold": 0.2})
    assert planner_config(mine, _hand_written_pipeline(), None, allow_moves=True) == {"threshold": 0.2}
    assert planner_config(VpipeConfig(planner="mypkg.plans:rebalance"), _hand_written_pipeline(), None,
                          allow_moves=True) is None


@pytest.mark.parametrize("options, message", [
    ({"micro_batches": 2, "schedule": "1f1b"},
     "vpipe config: planner_options cannot set micro_batches, schedule: attach reads them off the pipeline"),
    ({"confirm_sample": 1}, "planner config has unknown keys: confirm_sample"),
    ({"min_gain": 2}, "planner config: min_gain must be in [0, 1), got 2"),
])
def test_bad_planner_options_fail_at_attach(options, message):
    from vpipe import VpipeConfig
    from vpipe.rank.resolved import planner_config

    with pytest.raises(ValueError) as err:
        planner_config(VpipeConfig(planner_options=options), _hand_written_pipeline(), None, allow_moves=True)
    assert str(err.value) == message


@pytest.mark.cuda
def test_auto_budget_is_the_gpus_capacity_minus_a_margin():
    import torch

    from vpipe._attach import resolve_memory_budget

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    total = torch.cuda.get_device_properties(0).total_memory
    budget = resolve_memory_budget("auto", torch.device("cuda", 0))
    assert budget == total - max(1 << 30, int(total * 0.08)) and 0 < budget < total
