"""The CLI's runs, torchrun compatibility, and what happens when a rank dies."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from support.processes import ROOT, child_env, ranks_training, run_vpipe, training_pids, wait_while_running
from support.results import assert_params_equal, load_run_params
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.launch import rank_env
from vpipe_lab.runtime.reference import reference_flush, reference_pipedream


def _saved_run(out: Path, cfg: RunConfig) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Every rank's saved summary (rankN.json) and all ranks' parameters, checked to cover the model once."""
    metas = [json.loads((out / f"rank{r}.json").read_text()) for r in range(cfg.stages)]
    assert [m["stage"] for m in metas] == list(range(cfg.stages))
    assert [m["layer_ids"] for m in metas] == cfg.stage_layer_ids()  # every layer once, in model order
    assert all(m["steps"] == cfg.steps for m in metas)
    return metas, load_run_params(out, cfg.stages)


def test_train_pipedream_four_stages_trains_like_weight_stashing(tmp_path):
    cfg = RunConfig(stages=4, schedule="pipedream", steps=5, dropout=0.0)
    proc = run_vpipe("train", "--stages", "4", "--schedule", "pipedream", "--steps", "5", "--dropout", "0",
                     "--out-dir", str(tmp_path), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metas, params = _saved_run(tmp_path, cfg)
    assert all(m["trace"] for m in metas)  # the PipeDream schedule itself ran on every stage
    want_params, want_losses, _ = reference_pipedream(cfg)
    assert metas[-1]["losses"] == want_losses and len(want_losses) == 5
    assert all(not m["losses"] for m in metas[:-1])  # only the last stage computes the loss
    assert_params_equal(params, want_params)


def test_demo_runs_static_and_vpipe_through_both_edits(tmp_path):
    proc = run_vpipe("demo", "--steps", "12", "--add-step", "3", "--remove-step", "7", "--log-dir",
                     str(tmp_path),
                     timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = " ".join(proc.stdout.split())
    for phase in ("before the edits", "6 blocks added to stage 0", "2 blocks removed from stage 1"):
        assert phase in out
    assert "layers_added" in out and "layers_removed" in out
    assert "final layers per stage [9, 1]" in out  # static: the edits stay where they landed
    assert (tmp_path / "static.log").exists() and (tmp_path / "vpipe.log").exists()


def test_demo_rejects_edits_out_of_order():
    proc = run_vpipe("demo", "--add-step", "20", "--remove-step", "10")
    assert proc.returncode == 2
    assert "need 3 <= add step < remove step - 2 < steps - 4" in proc.stderr


def test_bad_arguments_fail_before_any_rank_starts():
    proc = run_vpipe("train", "--stages", "3", "--partition", "5,5")
    assert proc.returncode == 2
    assert "partition has 2 entries for 3 stages" in proc.stderr


def test_rank_env_reads_torchrun_variables():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    got = rank_env(env)
    assert ((got.rank, got.world_size, got.master_addr, got.master_port, got.agent_store)
            == (1, 4, "10.0.0.1", 29500, True))
    assert got.is_multi_host
    assert rank_env({}) is None
    with pytest.raises(ValueError, match="RANK=4 is outside"):
        rank_env(dict(env, RANK="4"))
    with pytest.raises(ValueError, match="MASTER_PORT is missing"):
        rank_env({k: v for k, v in env.items() if k != "MASTER_PORT"})


def test_torchrun_launch_trains_like_one_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "vpipe_lab", "train", "--stages", "2", "--steps", "2", "--dropout", "0", "--out-dir",
         str(tmp_path),
         "--no-progress"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = RunConfig(stages=2, steps=2, dropout=0.0)
    metas, params = _saved_run(tmp_path, cfg)
    want_params, want_losses, _ = reference_flush(cfg)
    assert metas[-1]["losses"] == want_losses and len(want_losses) == 2
    assert_params_equal(params, want_params)  # the ranks torchrun started trained as one pipeline


def _ranks(log_file: Path) -> dict[int, psutil.Process]:
    """The run's ranks, by the process ids they logged (children of the launcher, or of this test process's
    warm starter)."""
    descendants = {p.pid for p in psutil.Process().children(recursive=True)}
    return {rank: psutil.Process(pid) for rank, pid in training_pids(log_file).items() if pid in descendants}


def test_dead_rank_ends_every_rank_with_its_name(tmp_path):
    log_file = tmp_path / "run.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vpipe_lab", "train", "--stages", "4", "--steps", "100000", "--no-progress",
         "--log-file", str(log_file)],
        cwd=ROOT, env=child_env(VPIPE_HEARTBEAT_TIMEOUT="5"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True,
    )
    try:
        wait_while_running(lambda: ranks_training(log_file) == 4, 120, "every rank training", launcher)
        time.sleep(2.0)  # mid-run
        ranks = _ranks(log_file)
        assert sorted(ranks) == [0, 1, 2, 3]
        ranks[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert elapsed < 60, f"the run took {elapsed:.0f} s to stop"
    for rank in (0, 2, 3):
        lines = [ln for ln in stderr.splitlines() if ln.startswith(f"vpipe [rank {rank}]:")]
        assert lines and "rank 1 stopped answering (dead or hung)" in lines[-1], stderr[-3000:]
    assert "rank 1 exited first with code -9" in stderr


def test_a_stopped_rank_is_named_and_the_run_ends_within_the_heartbeat_timeout(tmp_path):
    log_file = tmp_path / "run.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vpipe_lab", "train", "--stages", "2", "--steps", "100000", "--blocks", "2",
         "--d-model", "16", "--seq-len", "8", "--no-progress", "--log-file", str(log_file)],
        cwd=ROOT, env=child_env(VPIPE_HEARTBEAT_TIMEOUT="4"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        wait_while_running(lambda: ranks_training(log_file) == 2, 120, "every rank training", launcher)
        time.sleep(1.0)
        ranks = _ranks(log_file)
        ranks[1].send_signal(signal.SIGSTOP)  # alive, but silent: no heartbeat, no exit
        stopped_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - stopped_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    # timeout + a few seconds
    assert elapsed < 4 + 8, f"the run took {elapsed:.0f} s to end after rank 1 stopped"
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("vpipe: run failed; rank 1 stopped answering (dead or hung): no heartbeat for "), (
        stderr
    )
    assert "so it was ended" in last and "rank 0 exited first" not in stderr
