"""Live migration is invisible to training: moved runs end exactly where unmoved ones do."""

from __future__ import annotations

import json

import pytest

from support.processes import run_vpipe
from support.results import assert_optimizer_equal, assert_params_equal, load_run_optimizer, load_run_params
from vpipe.log import read_log
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import reference_flush, reference_pipedream

SMALL = {"blocks": 6, "d_model": 32, "n_heads": 2, "seq_len": 16, "dropout": 0.0, "micro_batches": 4,
         "micro_batch_size": 2}

# 8 layers (embed, 6 blocks, head) or the CNN's 7: forward and backward moves, several layers at once
MOVES = {
    ("transformer", 2): [{"step": 3, "partition": [6, 2]}, {"step": 6, "partition": [2, 6]},
                         {"step": 9, "partition": [4, 4]}],
    ("transformer", 4): [{"step": 3, "partition": [1, 1, 1, 5]},  # several layers at once, some two hops
                         {"step": 6, "partition": [4, 2, 1, 1]},  # the other direction, two hops again
                         {"step": 9, "partition": [2, 2, 2, 2]}],
    # boundary shapes change
    ("cnn", 2): [{"step": 3, "partition": [5, 2]}, {"step": 6, "partition": [2, 5]}],
    ("cnn", 4): [{"step": 3, "partition": [1, 1, 1, 4]}, {"step": 8, "partition": [2, 2, 2, 1]}],
}


def _args(cfg: RunConfig, out_dir, log_file) -> list[str]:
    moves = ";".join(f"{m['step']}:{','.join(map(str, m['partition']))}" for m in cfg.moves or [])
    args = ["train", "--model", cfg.model, "--stages", str(cfg.stages), "--schedule", cfg.schedule,
            "--steps", str(cfg.steps), "--micro-batches", str(cfg.micro_batches),
            "--micro-batch-size", str(cfg.micro_batch_size), "--dropout", "0", "--blocks", str(cfg.blocks),
            "--d-model", str(cfg.d_model), "--n-heads", str(cfg.n_heads), "--seq-len", str(cfg.seq_len),
            "--out-dir", str(out_dir), "--log-file", str(log_file), "--no-progress", "--vpipe",
            "--no-planning"]
    if moves:
        args += ["--moves", moves]
    if cfg.vertical_sync:
        args.append("--vertical-sync")
    return args


def _run(cfg: RunConfig, tmp_path):
    proc = run_vpipe(*_args(cfg, tmp_path / "out", tmp_path / "run.log"), timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    final = [json.loads((out / f"rank{r}.json").read_text())["layer_ids"] for r in range(cfg.stages)]
    _run.traces = [json.loads((out / f"rank{r}.json").read_text()).get("trace") for r in range(cfg.stages)]
    return (load_run_params(out, cfg.stages), load_run_optimizer(out, cfg.stages), final,
            read_log(tmp_path / "run.log"))


def _expected_stages(cfg: RunConfig) -> list[list[int]]:
    return cfg.stage_layer_ids(cfg.steps)


# the 4-stage moves run in CI's slow run (4 ranks on 2 cores); the
# streamed 4-stage moves below stay in the default
@pytest.mark.parametrize("model,stages", [key if key[1] == 2 else pytest.param(*key, marks=pytest.mark.slow)
                                          for key in sorted(MOVES)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_moves_at_step_boundaries_are_transparent(schedule, model, stages, tmp_path):
    cfg = RunConfig(model=model, stages=stages, schedule=schedule, steps=12, moves=MOVES[(model, stages)],
                    vpipe=True, **SMALL)
    params, optim, final, log = _run(cfg, tmp_path)
    assert final == _expected_stages(cfg)  # the layers really moved
    want_params, _, want_optim = reference_flush(cfg)  # what any partition, fixed from the start, computes
    assert_params_equal(params, want_params)
    assert_optimizer_equal(optim, want_optim)
    done = [r for r in log if r.get("event") == "migration_done"]
    assert done and all(not r["aborted"] for r in done)
    if model == "cnn":
        assert any(r["rebuilt"] for r in done)  # boundary shapes changed: every rank redid shape inference


@pytest.mark.parametrize("vertical_sync", [True, False])
@pytest.mark.parametrize("stages", [2, 4])
def test_streamed_pipedream_moves_keep_weight_versions(stages, vertical_sync, tmp_path):
    moves = ([{"step": 3, "partition": [6, 2]}, {"step": 6, "partition": [3, 5]}] if stages == 2 else
             [{"step": 3, "partition": [1, 3, 2, 2]}, {"step": 6, "partition": [2, 2, 2, 2]}])
    cfg = RunConfig(stages=stages, schedule="pipedream", steps=9, moves=moves, vertical_sync=vertical_sync,
                    vpipe=True, **SMALL)
    params, optim, final, log = _run(cfg, tmp_path)
    assert final == _expected_stages(cfg)
    # micro-batch j runs every layer on the stage the partition of its step gives it, on that stage's version
    want_params, _, want_optim = reference_pipedream(cfg)
    assert_params_equal(params, want_params)
    assert_optimizer_equal(optim, want_optim)
    if vertical_sync:  # versions do not depend on the stage: the same as the final partition from the start
        fixed = RunConfig(**{**cfg.to_dict(), "moves": None, "partition": final and [len(s) for s in final],
                             "vpipe": False})
        assert_params_equal(params, reference_pipedream(fixed)[0])


    # no flush: once warm, every stage keeps its p-k micro-batches in flight through the moves (no drain)
    m = cfg.micro_batches
    for k, trace in enumerate(_run.traces):
        steady = [n for _, action, mb, n in trace if action == "F" and m <= mb < (cfg.steps - 1) * m]
        assert steady and min(steady) == stages - k, f"stage {k} drained: in flight {sorted(set(steady))}"


def test_streamed_two_hop_move(tmp_path):
    """A layer two stages away hops once per round; with vertical sync the result is the final partition's."""
    cfg = RunConfig(stages=4, schedule="pipedream", steps=10, moves=[{"step": 3, "partition": [1, 1, 1, 5]}],
                    vertical_sync=True, vpipe=True, **SMALL)
    params, _, final, log = _run(cfg, tmp_path)
    assert final == [[0], [1], [2], [3, 4, 5, 6, 7]]
    starts = [r for r in log if r.get("event") == "migration_start" and r["rank"] == 2]
    assert len(starts) == 2  # layer 3 passed through stage 2: two rounds
    fixed = RunConfig(**{**cfg.to_dict(), "moves": None, "partition": [1, 1, 1, 5], "vpipe": False})
    assert_params_equal(params, reference_pipedream(fixed)[0])
