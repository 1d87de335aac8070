"""Adding and removing layers while training runs: exactly what a single process doing the same computes."""

from __future__ import annotations

import json

import pytest

from conftest import assert_params_equal, load_run_params, run_vpipe
from vpipe.log import read_log
from vpipe.runtime.config import RunConfig
from vpipe.runtime.reference import reference_flush

SMALL = {"blocks": 4, "d_model": 32, "n_heads": 2, "seq_len": 16, "dropout": 0.0, "micro_batches": 4,
         "micro_batch_size": 2}
# 6 layers: embed 0, blocks 1-4, head 5. Add three blocks to stage 0, then remove one from each stage.
EDITS = [{"step": 2, "add": {"position": 1, "types": ["attn", "ffn", "conv"]}},
         {"step": 5, "remove": [7, 4]},
         {"step": 7, "add": {"position": 6, "types": ["ffn"]}}]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layer_edits_train_like_the_same_edits_in_one_process(schedule, tmp_path):
    cfg = RunConfig(stages=2, schedule=schedule, steps=9, vpipe=True, planning=False, nas=EDITS, **SMALL)
    proc = run_vpipe("train", "--stages", "2", "--schedule", schedule, "--steps", "9", "--blocks", "4",
                     "--d-model", "32", "--n-heads", "2", "--seq-len", "16", "--micro-batch-size", "2",
                     "--dropout", "0", "--vpipe", "--no-planning", "--nas", json.dumps(EDITS), "--no-progress",
                     "--out-dir", str(tmp_path), "--log-file", str(tmp_path / "run.log"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [json.loads((tmp_path / f"rank{r}.json").read_text())["layer_ids"] for r in range(2)]
    assert final == [[0, 6, 8, 1, 2], [3, 9, 5]]  # ids are never reused; the new layers joined their neighbours
    assert_params_equal(load_run_params(tmp_path, 2), reference_flush(cfg)[0])
    events = [r["event"] for r in read_log(tmp_path / "run.log") if r.get("event", "").startswith("layers_")]
    assert events.count("layers_added") == 4 and events.count("layers_removed") == 2  # logged by both ranks


def test_bad_layer_edits_are_rejected_before_training():
    proc = run_vpipe("train", "--vpipe", "--nas", '[{"step": 2, "remove": [0]}]')
    assert proc.returncode == 2
    assert "cannot remove [0]: not a block of the model at step 2" in proc.stderr
    proc = run_vpipe("train", "--nas", '[{"step": 2, "remove": [3]}]')
    assert "adding and removing layers needs vpipe" in proc.stderr
