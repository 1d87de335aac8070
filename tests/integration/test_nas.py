"""Adding and removing layers while training runs: exactly what a single process doing the same computes."""

from __future__ import annotations

import json

import pytest

from support.processes import run_vpipe
from support.results import assert_params_equal, load_run_params
from vpipe.log import read_log
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.reference import reference_flush

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
                     "--dropout", "0", "--vpipe", "--no-planning", "--nas", json.dumps(EDITS),
                     "--no-progress",
                     "--out-dir", str(tmp_path), "--log-file", str(tmp_path / "run.log"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [json.loads((tmp_path / f"rank{r}.json").read_text())["layer_ids"] for r in range(2)]
    # ids are never reused; the new layers joined their neighbours
    assert final == [[0, 6, 8, 1, 2], [3, 9, 5]]
    assert_params_equal(load_run_params(tmp_path, 2), reference_flush(cfg)[0])
    events = [r["event"] for r in read_log(tmp_path / "run.log") if r.get("event", "").startswith("layers_")]
    assert events.count("layers_added") == 4 and events.count("layers_removed") == 2  # logged by both ranks


def test_plot_needs_per_step_records(tmp_path):
    log = tmp_path / "empty.log"
    log.write_text('{"t": 1.0, "logger": "vpipe.decisions", "event": "attached", "msg": "x"}\n')
    proc = run_vpipe("plot", str(log), "-o", str(tmp_path / "x.png"))
    assert proc.returncode == 2
    assert "the log has no per-step records (logger vpipe.steps)" in proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_bad_layer_edits_are_rejected_before_training():
    proc = run_vpipe("train", "--vpipe", "--nas", '[{"step": 2, "remove": [0]}]')
    assert proc.returncode == 2
    assert "cannot remove [0]: not a block of the model at step 2" in proc.stderr
    proc = run_vpipe("train", "--nas", '[{"step": 2, "remove": [3]}]')
    assert "adding and removing layers needs vpipe" in proc.stderr


def test_mutations_follow_the_seed_and_respect_the_size_limits():
    import random

    from vpipe_lab.nas import Architecture

    def walk(seed: int) -> list[tuple[str, ...]]:
        rng, arch, seen = random.Random(seed), Architecture(("attn", "attn")), []
        for _ in range(40):
            arch = arch.mutate(rng, min_blocks=1, max_blocks=4)
            seen.append(arch.blocks)
        return seen

    assert walk(5) == walk(5) and walk(5) != walk(6)
    assert all(1 <= len(blocks) <= 4 for blocks in walk(5))
    with pytest.raises(ValueError, match="unknown block types \\['lstm'\\]"):
        Architecture(("attn", "lstm"))


def test_search_on_a_live_pipeline_repeats_under_its_seed(tmp_path):
    """Two searches with one seed: the same candidates, in order, with the same losses; the planner ran."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        proc = run_vpipe("nas", "--stages", "2", "--blocks", "2", "--d-model", "32", "--n-heads", "2",
                         "--seq-len", "16", "--micro-batches", "2", "--micro-batch-size", "2", "--dropout",
                         "0",
                         "--population", "2", "--sample", "2", "--cycles", "2", "--steps-per-candidate", "2",
                         "--seed", "3", "--no-progress", "--out-dir", str(out), "--log-file",
                         str(out / "run.log"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads((out / "nas.json").read_text()))
    assert runs[0] == runs[1]
    history = runs[0]["history"]
    assert len(history) == 4 and len({tuple(c["architecture"]) for c in history}) > 1
    assert runs[0]["best"]["loss"] == min(c["loss"] for c in history)
    logged = [r for r in read_log(tmp_path / "a" / "run.log") if r.get("event") == "nas_candidate"]
    assert [r["architecture"] for r in logged if r.get("rank") == 1] == [c["architecture"] for c in history]


def test_blocks_added_to_stage_0_are_rebalanced_live_and_train_like_one_process(tmp_path):
    """Planning on: the grown stage 0 is noticed and relieved by live moves; training is unchanged by them."""
    edits = [{"step": 4, "add": {"position": 1, "types": ["attn"] * 8}}]
    model = {"blocks": 4, "d_model": 128, "n_heads": 4, "seq_len": 64, "dropout": 0.0, "micro_batches": 4,
             "micro_batch_size": 4}
    cfg = RunConfig(stages=2, schedule="1f1b", steps=20, vpipe=True, nas=edits, monitor_every=2, **model)
    proc = run_vpipe("train", "--stages", "2", "--schedule", "1f1b", "--steps", "20", "--blocks", "4",
                     "--d-model", "128", "--n-heads", "4", "--seq-len", "64", "--micro-batch-size", "4",
                     "--dropout", "0", "--vpipe", "--monitor-every", "2", "--nas", json.dumps(edits),
                     "--no-progress", "--out-dir", str(tmp_path), "--log-file", str(tmp_path / "run.log"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(tmp_path / "run.log")
    plans = [r for r in log if r.get("event") == "plan"]
    assert plans and len(plans[0]["old_stages"][0]) == 11  # the planner saw the grown stage 0 ...
    assert len(plans[0]["new_stages"][0]) < 11  # ... and moved layers off it
    final = [json.loads((tmp_path / f"rank{r}.json").read_text())["layer_ids"] for r in range(2)]
    assert len(final[0]) < 11 and sorted(final[0] + final[1]) == list(range(14))
    assert_params_equal(load_run_params(tmp_path, 2), reference_flush(cfg)[0], rtol=1e-6)

    # the run as a picture: throughput per step, layers per stage, the edit and the moves marked
    png = tmp_path / "run.png"
    drawn = run_vpipe("plot", str(tmp_path / "run.log"), "-o", str(png))
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from vpipe_lab.plot import series_from_log

    series = series_from_log(log)
    assert len(series.step) == 19  # every step but the last (its end is the run's end, no boundary follows)
    assert {kind for _, kind in series.marks} == {"added", "moved"}
    assert series.layers[0][0][1] == 3 and max(n for _, n in series.layers[0]) == 11
    assert series.layers[0][-1][1] == len(final[0]) and series.layers[1][-1][1] == len(final[1])
