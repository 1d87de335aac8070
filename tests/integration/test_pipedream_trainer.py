"""A user's PipeDream trainer (examples/train_pipedream.py, vpipe.SchedulePipeDream, ranks
started as torchrun starts them) with and without the one line: a streamed move mid-run
leaves the result the schedule gives on the final partition."""

from __future__ import annotations

import json

import torch

from support.processes import ROOT, child_env, run_ranks
from vpipe.log import read_log

STEPS = 8


def _train(tmp_path, name: str, *args: str) -> tuple[dict, dict[str, torch.Tensor], list[dict]]:
    out, log_file = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    run_ranks([str(ROOT / "examples" / "train_pipedream.py"), "--steps", str(STEPS), "--vertical-sync",
               "--out",
               str(out), *args], 2, tmp_path / f"{name}.txt", child_env(VPIPE_LOG_FILE=str(log_file)))
    state = {k: v for r in range(2) for k, v in torch.load(f"{out}.rank{r}.pt", weights_only=True).items()}
    return json.loads(out.read_text()), state, read_log(log_file) if log_file.exists() else []


def test_a_streamed_move_in_a_users_pipedream_trainer_ends_as_the_schedule_alone_on_the_final_split(tmp_path):
    plain, plain_state, _ = _train(tmp_path, "plain", "--partition", "4,4")
    moved, moved_state, log = _train(tmp_path, "vpipe", "--partition", "6,2", "--vpipe", "--no-planning",
                                     "--move", "3:4,4")
    assert any(r.get("event") == "migration_start" for r in log)  # streamed: no flush
    assert sorted(moved_state) == sorted(plain_state) and len(plain_state) == 8 * 6
    assert all(torch.equal(moved_state[k], plain_state[k]) for k in plain_state)  # by global layer id
    assert moved["losses"] == plain["losses"]  # the last stage's losses, bit for bit
