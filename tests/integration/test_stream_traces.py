"""A trace window under vpipe's streamed schedules, PipeDream-2BW (one stage a rank) and WPipe (G0's and
G1's stage a rank): `vpipe trace` merges the ranks' files into one Chrome trace with a track per stage,
each holding the forward and the backward of every micro-batch of the window's steps, and vpipe's
recomputes on the stage that recomputes (tests/workers/stream_trace_worker.py)."""

from __future__ import annotations

import json

import pytest

from support.processes import WORKERS, run_ranks
from support.twobw import MICRO_BATCHES
from vpipe import timeline
from vpipe.cli import main as cli_main

WINDOW_STEPS = 3


@pytest.mark.parametrize(("schedule", "stages"), [("2bw", 2), ("wpipe", 4)])
def test_a_trace_window_under_a_stream_shows_every_stage_and_each_micro_batch_once(tmp_path, schedule,
                                                                                   stages):
    trace_dir, out = tmp_path / "trace", tmp_path / "trace.json"
    run_ranks([str(WORKERS / "stream_trace_worker.py"), str(trace_dir), schedule], 2, tmp_path / "output.txt",
              timeout_s=240)
    assert sorted(p.name for p in trace_dir.iterdir()) == ["timeline-rank0.json", "timeline-rank1.json"]
    assert cli_main(["trace", str(trace_dir), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {tracks[s] for s in range(stages)} == {f"stage {s}" for s in range(stages)}
    spans = [e for e in events if e["ph"] == "X"]
    for stage in range(stages):
        for name in ("vpipe.forward", "vpipe.backward"):
            mbs = [e["args"]["mb"] for e in spans if e["name"] == name and e["tid"] == stage]
            assert len(mbs) == WINDOW_STEPS * MICRO_BATCHES, (stage, name, mbs)
    assert any(e["name"] == "vpipe.recompute" and e["tid"] == 0 for e in spans)
    fractions = timeline.stage_fractions(timeline.load_run(trace_dir))
    assert sorted(f.stage for f in fractions) == list(range(stages))
