"""A move whose target never answers, or dies, must not lose a layer or hang the run."""

from __future__ import annotations

import json
import time

from support.processes import child_env, run_vpipe
from support.results import assert_params_equal, load_run_params
from vpipe.log import read_log
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import reference_flush

ARGS = ["train", "--stages", "2", "--steps", "6", "--blocks", "4", "--d-model", "32", "--n-heads", "2",
        "--seq-len", "16", "--micro-batch-size", "2", "--dropout", "0", "--vpipe", "--no-planning",
        "--moves", "3:1,5", "--no-progress"]


def test_silent_target_aborts_the_move_and_training_continues(tmp_path):
    env = child_env(VPIPE_FAULTS="migration_silent@1", VPIPE_MIGRATION_TIMEOUT="2")
    proc = run_vpipe(*ARGS, "--out-dir", str(tmp_path / "out"), "--log-file", str(tmp_path / "run.log"),
                     env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text())["layer_ids"] for r in range(2)]
    assert final == [[0, 1, 2], [3, 4, 5]]  # the old placement: the source kept its layer
    aborted = [r for r in read_log(tmp_path / "run.log") if r.get("event") == "migration_aborted"]
    assert {r["rank"] for r in aborted} == {0, 1}  # both sides agree the move did not happen
    cfg = RunConfig(stages=2, steps=6, blocks=4, d_model=32, n_heads=2, seq_len=16, micro_batch_size=2,
                    dropout=0.0)
    # nothing lost or changed
    assert_params_equal(load_run_params(tmp_path / "out", 2), reference_flush(cfg)[0])


def test_target_dying_mid_move_stops_every_rank_naming_it(tmp_path):
    env = child_env(VPIPE_FAULTS="migration_die@1", VPIPE_HEARTBEAT_TIMEOUT="5")
    started = time.monotonic()
    proc = run_vpipe(*ARGS, "--log-file", str(tmp_path / "run.log"), env=env, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - started < 90
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("vpipe [rank 0]:")]
    assert lines and "rank 1 stopped answering (dead or hung)" in lines[-1], proc.stderr[-3000:]
    source = [r for r in read_log(tmp_path / "run.log") if r["rank"] == 0
              and r.get("event") == "migration_done"]
    assert not source  # the source never dropped the layer it was sending
