"""A pipeline run must train exactly like one process running the same micro-batches."""

from __future__ import annotations

import json

import pytest

from support.processes import run_vpipe
from support.results import assert_params_equal, load_run_params
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import reference_flush, reference_pipedream

SMALL = {"blocks": 4, "d_model": 32, "n_heads": 2, "seq_len": 16, "dropout": 0.0,
         "micro_batches": 4, "micro_batch_size": 2}


def _args(cfg: RunConfig, out_dir) -> list[str]:
    args = ["train", "--model", cfg.model, "--stages", str(cfg.stages), "--schedule", cfg.schedule,
            "--steps", str(cfg.steps), "--micro-batches", str(cfg.micro_batches),
            "--micro-batch-size", str(cfg.micro_batch_size), "--dropout", "0",
            "--blocks", str(cfg.blocks), "--d-model", str(cfg.d_model), "--n-heads", str(cfg.n_heads),
            "--seq-len", str(cfg.seq_len), "--out-dir", str(out_dir), "--no-progress"]
    if cfg.vertical_sync:
        args.append("--vertical-sync")
    return args


def _run(cfg: RunConfig, tmp_path):
    proc = run_vpipe(*_args(cfg, tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads((tmp_path / f"rank{cfg.stages - 1}.json").read_text())
    return load_run_params(tmp_path, cfg.stages), last["losses"]


@pytest.mark.parametrize("model", ["transformer", "cnn"])
# 4 ranks on 2 cores: CI's slow run
@pytest.mark.parametrize("stages", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flush_schedules_match_gradient_accumulation(schedule, stages, model, tmp_path):
    cfg = RunConfig(model=model, stages=stages, schedule=schedule, steps=3, **SMALL)
    params, losses = _run(cfg, tmp_path)
    want_params, want_losses, _ = reference_flush(cfg)
    assert_params_equal(params, want_params)  # bitwise: same ops, same summation order
    assert losses == want_losses


@pytest.mark.parametrize("vertical_sync", [False, True])
@pytest.mark.parametrize("stages", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_pipedream_matches_weight_stashing_simulation(stages, vertical_sync, tmp_path):
    # 2 steps x 4 micro-batches = 8 micro-batch updates per stage
    cfg = RunConfig(stages=stages, schedule="pipedream", steps=2, vertical_sync=vertical_sync, **SMALL)
    params, losses = _run(cfg, tmp_path)
    want_params, want_losses, _ = reference_pipedream(cfg)
    assert_params_equal(params, want_params)
    assert losses == pytest.approx(want_losses, rel=0, abs=0)


def test_pipedream_is_not_a_flush_schedule(tmp_path):
    """Guard against a reference that cannot tell the semantics apart: stashing differs from accumulation."""
    cfg = RunConfig(stages=2, schedule="pipedream", steps=2, **SMALL)
    params, _ = _run(cfg, tmp_path)
    flush_params, _, _ = reference_flush(RunConfig(stages=2, schedule="gpipe", steps=2, **SMALL))
    assert any(not params[k].equal(v) for k, v in flush_params.items())
