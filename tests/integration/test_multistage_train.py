"""`vpipe train` with several virtual stages per rank trains exactly
like one process running the same micro-batches.

Every case is a real run through the CLI (gloo, 2 ranks x 2 virtual stages unless said
otherwise) compared with :func:`reference_flush`: without vpipe, with vpipe swapping or
recomputing every block, and with moves forced over virtual stages (across ranks, and on
the V-shaped schedules between the two stages of one rank). Bad layouts end the command
with one error line and status 2.
"""

from __future__ import annotations

import json

import pytest

from support.processes import run_vpipe
from support.results import assert_optimizer_equal, assert_params_equal, load_run_optimizer, load_run_params
from vpipe.log import read_log
from vpipe_lab.cli import main as cli_main
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import reference_flush

SMALL = {"blocks": 4, "d_model": 32, "n_heads": 2, "seq_len": 16, "dropout": 0.0, "micro_batches": 4,
         "micro_batch_size": 2}
SCHEDULES = ["interleaved1f1b", "loopedbfs", "interleavedzb", "zbv", "dualpipev"]
V_SHAPED = ("zbv", "dualpipev")
# 6 layers on 4 virtual stages, [2, 2, 1, 1] at first: one layer 0 -> 1 and one 1 -> 2 (inside rank 1 on a V),
# then back towards the ends (2 -> 3 crosses to rank 0 on a V)
MOVES = [{"step": 2, "partition": [1, 2, 2, 1]}, {"step": 4, "partition": [2, 1, 1, 2]}]


def _args(cfg: RunConfig, out_dir, log_file) -> list[str]:
    args = ["train", "--schedule", cfg.schedule, "--stages", str(cfg.stages), "--steps", str(cfg.steps),
            "--micro-batches", str(cfg.micro_batches), "--micro-batch-size", str(cfg.micro_batch_size),
            "--dropout", "0", "--blocks", str(cfg.blocks), "--d-model", str(cfg.d_model), "--n-heads",
            str(cfg.n_heads), "--seq-len", str(cfg.seq_len), "--out-dir", str(out_dir), "--log-file",
            str(log_file),
            "--no-progress"]
    if cfg.vpipe:
        args += ["--vpipe", "--no-planning", "--policy", cfg.policy]
    if cfg.moves:
        args += ["--moves", ";".join(f"{m['step']}:{','.join(map(str, m['partition']))}" for m in cfg.moves)]
    if cfg.nas:
        args += ["--nas", json.dumps(cfg.nas)]
    return args


def _run(cfg: RunConfig, tmp_path, *extra: str) -> dict:
    out, log_file = tmp_path / "out", tmp_path / "run.log"
    proc = run_vpipe(*_args(cfg, out, log_file), *extra, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(cfg.stages)]
    return {"params": load_run_params(out, cfg.stages), "optimizer": load_run_optimizer(out, cfg.stages),
            "ranks": ranks, "losses": next(r["losses"] for r in ranks if r["losses"]),
            "log": read_log(log_file) if log_file.exists() else []}


def _assert_reference(run: dict, cfg: RunConfig) -> None:
    want_params, want_losses, want_optim = reference_flush(cfg)
    assert_params_equal(run["params"], want_params)  # bitwise: same ops, same order of accumulation
    assert_optimizer_equal(run["optimizer"], want_optim)
    assert run["losses"] == want_losses


def _final_stages(run: dict, cfg: RunConfig) -> list[list[int]]:
    """Each virtual stage's layers at the end, from the ranks' results."""
    stages: list[list[int]] = [[] for _ in range(cfg.virtual_stages)]
    for rank in run["ranks"]:
        for v, ids in zip(rank["stages"], rank["stage_layer_ids"]):
            stages[v] = ids
    return stages


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_multi_stage_schedules_match_gradient_accumulation(schedule, tmp_path):
    cfg = RunConfig(schedule=schedule, stages=2, steps=3, **SMALL)
    run = _run(cfg, tmp_path)
    # the stages sit where torch's schedule runs them: looped r, r + 2; V-shaped r, 3 - r
    layout = [[0, 3], [1, 2]] if schedule in V_SHAPED else [[0, 2], [1, 3]]
    assert [r["stages"] for r in run["ranks"]] == layout
    assert _final_stages(run, cfg) == [[0, 1], [2, 3], [4], [5]]
    _assert_reference(run, cfg)


@pytest.mark.parametrize("schedule,policy", list(zip(SCHEDULES, "SRSRS")))
def test_vpipe_swapping_or_recomputing_every_block_keeps_the_result(schedule, policy, tmp_path):
    cfg = RunConfig(schedule=schedule, stages=2, steps=3, vpipe=True, policy=policy, **SMALL)
    run = _run(cfg, tmp_path)
    attached = {(r["stage"], r["rank"]) for r in run["log"] if r.get("event") == "attached"}
    assert attached == {(v, cfg.stage_rank(v)) for v in range(4)}  # a tensor manager per virtual stage
    assert set(run["ranks"][0]["memory"]["policies"].values()) == {policy}
    _assert_reference(run, cfg)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forced_moves_over_virtual_stages_are_transparent(schedule, tmp_path):
    cfg = RunConfig(schedule=schedule, stages=2, steps=6, vpipe=True, moves=MOVES, **SMALL)
    run = _run(cfg, tmp_path)
    assert _final_stages(run, cfg) == cfg.stage_layer_ids(cfg.steps) == [[0, 1], [2], [3], [4, 5]]
    done = [r for r in run["log"] if r.get("event") == "migration_done" and r.get("moved")]
    assert done and not any(r["aborted"] for r in done)
    _assert_reference(run, cfg)  # what the final partition, fixed from the start, computes


def test_four_ranks_of_a_v_with_forced_moves(tmp_path):
    moves = [{"step": 2, "partition": [1, 1, 1, 2, 1, 1, 1, 2]},
             {"step": 4, "partition": [2, 1, 1, 1, 1, 1, 1, 2]}]
    cfg = RunConfig(schedule="zbv", stages=4, steps=5, vpipe=True, moves=moves, **{**SMALL, "blocks": 8})
    run = _run(cfg, tmp_path)
    assert [r["stages"] for r in run["ranks"]] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [len(ids) for ids in _final_stages(run, cfg)] == [2, 1, 1, 1, 1, 1, 1, 2]
    _assert_reference(run, cfg)


def test_layer_edits_on_virtual_stages(tmp_path):
    nas = [{"step": 2, "add": {"position": 1, "types": ["attn", "ffn"]}}, {"step": 4, "remove": [2]}]
    cfg = RunConfig(schedule="interleaved1f1b", stages=2, steps=6, vpipe=True, nas=nas, **SMALL)
    run = _run(cfg, tmp_path)
    assert _final_stages(run, cfg) == [[0, 6, 7, 1], [3], [4], [5]]  # the new blocks joined stage 0
    _assert_reference(run, cfg)


@pytest.mark.parametrize("schedule,vpipe", [("interleaved1f1b", False), ("zbv", True)])
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(schedule, vpipe, tmp_path):
    cfg = RunConfig(schedule=schedule, stages=2, steps=6, vpipe=vpipe, **SMALL)
    first = RunConfig(**{**cfg.to_dict(), "steps": 3})
    _run(first, tmp_path / "first", "--checkpoint-dir", str(tmp_path / "ckpt"))
    run = _run(cfg, tmp_path / "second", "--resume", str(tmp_path / "ckpt"))
    want_params, want_losses, want_optim = reference_flush(cfg)
    assert_params_equal(run["params"], want_params)
    assert_optimizer_equal(run["optimizer"], want_optim)
    assert run["losses"] == want_losses[3:]


def test_every_virtual_stage_reports_to_the_planner_daemon(tmp_path):
    from support.control_runs import MARKER, planner_env, received
    from vpipe.monitors.records import StageRecord

    out = tmp_path / "planner.jsonl"
    proc = run_vpipe("train", "--schedule", "zbv", "--stages", "2", "--steps", "6", "--monitor-every", "3",
                     "--no-progress", "--blocks", "4", "--d-model", "32", "--seq-len", "16", "--planner",
                     MARKER,
                     "--log-file", str(tmp_path / "run.log"), env=planner_env(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    vectors = received(out)
    assert [v["iteration"] for v in vectors] == [2, 5]
    for v in vectors:
        records = [StageRecord.from_wire(r) for r in v["records"]]
        assert [(r.stage, r.layer_ids) for r in records] == [(0, [0, 1]), (1, [2, 3]), (2, [4]), (3, [5])]
        assert all(layer.fwd_calls == 4 and layer.bwd_calls == 4 for r in records for layer in r.layers)


@pytest.mark.parametrize("args, message", [
    (["--schedule", "zbv", "--stages-per-rank", "3"],
     "zbv runs exactly 2 stages per rank (a V), got stages_per_rank 3"),
    (["--schedule", "1f1b", "--stages-per-rank", "2"],
     "1f1b runs one stage per rank; 2 stages per rank need a multi-stage schedule "
     "(interleaved1f1b, loopedbfs, interleavedzb, zbv, dualpipev, wpipe)"),
    (["--schedule", "loopedbfs", "--stages-per-rank", "1"],
     "loopedbfs runs several stages per rank: stages_per_rank must be >= 2, got 1 (1f1b "
     "runs one stage per rank)"),
    (["--schedule", "interleaved1f1b", "--vertical-sync"],
     "vertical_sync is a PipeDream option; interleaved1f1b keeps no weight versions"),
    (["--schedule", "interleavedzb", "--micro-batches", "5"],
     "interleavedzb needs micro_batches to be a multiple of its rounds, max(1, micro_batches "
     "// ranks) = 2; got 5 micro-batches on 2 ranks"),
    (["--schedule", "dualpipev", "--micro-batches", "3"],
     "dualpipev needs micro_batches >= its 4 stages, got 3"),
    (["--schedule", "zbv", "--partition", "4,2"], "partition has 2 entries for 4 stages (2 ranks x 2)"),
    (["--schedule", "loopedbfs", "--stages", "4", "--blocks", "4"],
     "8 stages (4 ranks x 2) but the model has only 6 layers"),
    (["--schedule", "zbv", "--vpipe", "--moves", "2:3,1,1,1,1"],
     "moves[0]: partition [3, 1, 1, 1, 1] must give each of the 4 stages (2 ranks x 2) >= 1 of the 6 layers"),
])
def test_bad_layouts_end_with_one_error_line_and_status_2(args, message, capsys):
    assert cli_main(["train", "--blocks", "4", "--no-progress", *args]) == 2
    assert capsys.readouterr().err == f"vpipe: error: {message}\n"


def test_where_plain_interleaved_1f1b_fits_a_budget_vpipe_keeps_every_layer_and_sends_no_plan(tmp_path):
    """A rank's two stages do not peak at once: plain Interleaved 1F1B fits a budget that the
    stages' own peaks added up pass. vpipe shares the rank's budget by its real peak, so it keeps
    every layer too, and the planner finds nothing to fix."""
    from vpipe_lab.runtime.fit import pipeline_fit

    cfg = RunConfig(model="cnn", schedule="interleaved1f1b", stages=2, steps=6, micro_batches=4,
                    micro_batch_size=16,
                    partition=[1, 1, 2, 3], vpipe=True)
    plain = pipeline_fit(RunConfig(**{**cfg.to_dict(), "vpipe": False}), 1 << 62, managed=False)
    # 6% over plain's footprint: the first step runs on equal halves and swaps stage 0's block, which then
    # counts its activations summed (12% over what it keeps for this block) until it keeps every layer again
    budget = int(max(rank.footprint_bytes for rank in plain.stages) * 1.06)
    out, log_file = tmp_path / "out", tmp_path / "run.log"
    proc = run_vpipe("train", "--model", "cnn", "--schedule", "interleaved1f1b", "--stages", "2", "--steps",
                     "6",
                     "--micro-batches", "4", "--micro-batch-size", "16", "--partition", "1,1,2,3", "--vpipe",
                     "--memory-budget", str(budget), "--out-dir", str(out), "--log-file", str(log_file),
                     "--no-progress", timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(set(rank["memory"]["policies"].values()) == {"D"} for rank in ranks)
    # every layer kept, each manager's peak is its stage's own: added up they pass the budget, so shares in
    # proportion to them would have left stage 0 less than it needs
    own_peaks = [rank["memory"]["fixed_bytes"] + rank["memory"]["peak_saved_bytes"] for rank in ranks]
    assert max(own_peaks) > budget
    plans = [e for e in read_log(log_file) if e.get("kind") == "plan"]
    assert plans == []
    _, want_losses, _ = reference_flush(cfg)
    assert next(r["losses"] for r in ranks if r["losses"]) == want_losses
