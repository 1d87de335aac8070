"""The pipeline timeline: a window of steps recorded on every rank, merged by
`vpipe trace` into one Chrome trace with each stage's busy / bubble / waiting
fractions; vpipe's work under its own names in torch.profiler."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from support.processes import WORKERS, run_ranks
from vpipe import timeline
from vpipe.cli import main as cli_main
from vpipe.config import VpipeConfig
from vpipe.settings import process_settings


def _trained(tmp_path: Path, scenario: str = "timeline") -> tuple[dict, Path]:
    out, trace_dir = tmp_path / "out.json", tmp_path / "trace"
    run_ranks([str(WORKERS / "trace_worker.py"), str(out), str(trace_dir), scenario], 2,
              tmp_path / "output.txt",
              timeout_s=240)
    return json.loads(out.read_text()), trace_dir


def test_a_trace_window_gives_one_chrome_trace_with_every_micro_batch_and_the_light_stage_in_the_bubble(
        tmp_path, capsys):
    result, trace_dir = _trained(tmp_path)
    assert result["written_after_window"] == ["timeline-rank0.json", "timeline-rank1.json"]
    # vpipe's own work is named in the user's torch.profiler trace (outside the window too)
    assert {"vpipe.forward", "vpipe.backward", "vpipe.recompute"} <= set(result["profiler_ranges"])

    out = tmp_path / "trace.json"
    assert cli_main(["trace", str(trace_dir), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"
              and e["name"] == "thread_name"}
    assert tracks[(0, 0)] == "stage 0" and tracks[(1, 1)] == "stage 1"  # one track per stage
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    for stage in (0, 1):
        for name in ("vpipe.forward", "vpipe.backward"):
            mbs = sorted(e["args"]["mb"] for e in spans if e["name"] == name and e["tid"] == stage)
            assert mbs == sorted([0, 1, 2, 3] * 3), (stage, name)  # every micro-batch of the 3 steps
    # on the stage that recomputes
    assert any(e["name"] == "vpipe.recompute" and e["tid"] == 0 for e in spans)
    assert any(e["name"] == "vpipe.p2p_wait" and e["tid"] == timeline.RANK_TRACK for e in spans)

    fractions = {f.stage: f for f in timeline.stage_fractions(timeline.load_run(trace_dir))}
    heavy, light = fractions[0], fractions[1]  # 6 blocks and the embedding vs 2 blocks and the head
    assert light.bubble > heavy.bubble
    assert all(0.0 <= f.busy <= 1.0 and abs(f.busy + f.bubble - 1.0) < 1e-9 and f.waiting <= f.bubble + 1e-9
               for f in fractions.values())
    assert f"{0:5d}  {0:4d}  {heavy.busy:5.0%}" in printed and "busy  bubble  (waiting)" in printed


def test_trace_names_what_is_wrong_with_a_run_directory_in_one_line(tmp_path, capsys):
    assert cli_main(["trace", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli_main(["trace", str(tmp_path)]) == 2
    assert "no timeline-rankN.json files in" in capsys.readouterr().err
    (tmp_path / "timeline-rank0.json").write_text("{not json")
    assert cli_main(["trace", str(tmp_path)]) == 2
    assert "is not a vpipe timeline file" in capsys.readouterr().err
    (tmp_path / "timeline-rank0.json").write_text(json.dumps({"format": "vpipe-timeline", "version": 1,
                                                              "rank": 0,
                                                             "stages": [0], "events": [{"name": "x"}]}))
    assert cli_main(["trace", str(tmp_path)]) == 2
    assert "event 0 is malformed" in capsys.readouterr().err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):  # never opened: a FIFO would hang a reader
        timeline.load_rank_file(fifo)


def test_trace_png_into_a_file_used_as_a_directory_is_one_line_before_any_output(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "timeline-rank0.json").write_text(json.dumps({"format": "vpipe-timeline", "version": 1, "rank": 0,
                                                        "stages": [0], "events": []}))
    afile = tmp_path / "file"
    afile.write_text("")
    out = tmp_path / "trace.json"
    assert cli_main(["trace", str(run), "-o", str(out), "--png", f"{afile}/x.png"]) == 2
    assert capsys.readouterr().err.strip() == f"vpipe: error: --png {afile}/x.png: {afile} is not a directory"
    assert not out.exists()


def test_the_fractions_count_overlapping_work_once_and_waits_inside_the_bubble():
    ms = 1_000_000

    def ev(name, cat, track, start, end):
        return {"name": name, "cat": cat, "track": track, "start_ns": start * ms, "end_ns": end * ms,
                "args": {}}

    ranks = [timeline.RankTimeline(0, [0], [ev("f", "compute", 0, 0, 6), ev("r", "memory", 0, 1, 2),
                                            ev("b", "compute", 0, 5, 8)], 0),
             timeline.RankTimeline(1, [1], [ev("f", "compute", 1, 2, 4), ev("w", "comm", -1, 4, 9),
                                            ev("b", "compute", 1, 9, 10)], 0)]
    got = {f.stage: (round(f.busy, 6), round(f.bubble, 6), round(f.waiting, 6))
           for f in timeline.stage_fractions(ranks)}
    assert got == {0: (0.8, 0.2, 0.0), 1: (0.3, 0.7, 0.5)}  # window 0..10 ms; stage 0's spans overlap (5..6)
    merged = timeline.merge(ranks)
    assert [e["ts"] for e in merged["traceEvents"] if e["ph"] == "X"] == [0.0, 1000.0, 5000.0, 2000.0, 4000.0,
                                                                             9000.0]


def test_trace_steps_are_checked_where_they_enter(monkeypatch):
    with pytest.raises(ValueError,
                       match=r"trace_steps must be \(start, count\) with start >= 0 and count >= 1"):
        VpipeConfig(trace_steps=(-1, 3))
    with pytest.raises(ValueError, match="trace_steps must be"):
        VpipeConfig(trace_steps=(2, 0))
    monkeypatch.setenv("VPIPE_TRACE_STEPS", "5")
    process_settings.cache_clear()  # as a process started with this environment
    with pytest.raises(ValueError, match="VPIPE_TRACE_STEPS='5': expected START,COUNT"):  # as attach says it
        VpipeConfig()
    monkeypatch.setenv("VPIPE_TRACE_STEPS", "5,2")  # a bad value is not kept: the next config reads again
    monkeypatch.setenv("VPIPE_TRACE_DIR", "/tmp/somewhere")
    config = VpipeConfig()
    assert (config.trace_steps, config.trace_dir) == ((5, 2), "/tmp/somewhere")


def test_outside_a_window_and_the_profiler_a_span_is_one_shared_nothing():
    assert not timeline.recording()
    assert timeline.span("vpipe.x", timeline.MEMORY) is timeline.span("vpipe.y", timeline.COMPUTE, 3, mb=1)


EVERY_STEP = ["step_time_s", "plan_epoch", "stage{k}/layers", "stage{k}/peak_saved_bytes",
              "stage{k}/swapped_bytes",
              "stage{k}/recompute_s"]
SAMPLED = ["stage{k}/compute_s", "stage{k}/bubble", "stage{k}/device_peak_bytes"]


def test_metrics_go_to_tensorboard_for_every_step_and_the_sampled_ones_on_sampled_steps(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    result, directory = _trained(tmp_path, "metrics")
    steps = list(range(result["steps"]))
    for rank in (0, 1):
        acc = event_accumulator.EventAccumulator(str(directory / f"rank{rank}"))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])

        def series(tag, rank=rank, acc=acc):
            return {e.step: e.value for e in acc.Scalars(tag.format(k=rank))}

        for tag in EVERY_STEP:
            assert sorted(series(tag)) == steps, (rank, tag)
        assert set(series("stage{k}/layers").values()) == {6.0 if rank == 0 else 2.0}
        assert all(v > 0 for v in series("step_time_s").values())
        recomputed = series("stage{k}/recompute_s")
        assert (sum(recomputed.values()) > 0) == (rank == 0)  # block 1 (stage 0) is recomputed
        # the monitor samples every 3rd step (sample_every=3): those
        # steps, and no other, carry the sampled fields
        sampled = sorted(series("stage{k}/compute_s"))
        assert len(sampled) >= 2 and sampled == list(range(sampled[0], len(steps), 3)), sampled
        for tag in SAMPLED:
            assert sorted(series(tag)) == sampled
        assert all(0.0 <= b <= 1.0 for b in series("stage{k}/bubble").values())
        assert f"stage{1 - rank}/layers" not in tags  # each rank writes its own stages


def test_metrics_name_the_backend_and_the_missing_package(monkeypatch):
    with pytest.raises(ValueError, match=r"metrics must name tensorboard and/or wandb \(comma-separated\), "
                                         r"got 'tensorbord'"):
        VpipeConfig(metrics="tensorbord")
    from vpipe.rank import metrics

    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="metrics='wandb' needs the wandb package: pip install wandb"):
        metrics.MetricsWriter(("wandb",), "/tmp/unused", rank=0)


def test_metrics_reach_weights_and_biases_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from vpipe.rank.metrics import MetricsWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    writer = MetricsWriter(("wandb",), tmp_path, rank=0)
    values = writer.step(0, 0.5, 3, {0: (4, None)}, [])
    writer.close()
    wandb.teardown()  # what a trainer's exit does: W&B's service process writes out what it holds
    assert values == {"step_time_s": 0.5, "plan_epoch": 3.0, "stage0/layers": 4.0}
    (run_file,) = (tmp_path / "rank0" / "wandb").glob("offline-run-*/run-*.wandb")
    # The offline run's records: each logged key is in them, as W&B would sync it.
    # W&B's service process writes them and may flush after finish() returns (a CI
    # run once read the file too early), so wait for them.
    deadline = time.monotonic() + 30
    while missing := [key for key in values if key.encode() not in run_file.read_bytes()]:
        assert time.monotonic() < deadline, f"{missing} not in {run_file} ({run_file.stat().st_size} bytes)"
        time.sleep(0.2)
