"""vpipe's checkpoints under the streams that update once a period: PipeDream-2BW and WPipe on two real gloo
ranks (tests/workers/stream_checkpoint_worker.py). A run flushes after step 3, saves with
``vpipe.checkpoint.save_checkpoint`` and stops; fresh processes restore it, attach vpipe, load its state and
train to step 6: weights and losses bitwise those of a run that flushed at step 3 and went on."""

from __future__ import annotations

import pytest
import torch

from support.processes import WORKERS, run_ranks

RANKS = 2


def _run(tmp, schedule: str, part: str, root) -> list[dict]:
    out = tmp / f"{schedule}-{part}"
    run_ranks([str(WORKERS / "stream_checkpoint_worker.py"), schedule, part, str(root), str(out)], RANKS,
              tmp / f"{schedule}-{part}.txt")
    runs = [torch.load(f"{out}.rank{r}.pt", weights_only=True)["run"] for r in range(RANKS)]
    for run in runs:
        run["state"] = dict(run["state"])
    return runs


@pytest.mark.parametrize("schedule", ["2bw", "wpipe"])
def test_a_stream_saved_after_a_flush_resumes_in_fresh_processes_bitwise(tmp_path, schedule):
    root = tmp_path / "ck"
    whole = _run(tmp_path, schedule, "whole", tmp_path / "unused")
    _run(tmp_path, schedule, "first", root)
    resumed = _run(tmp_path, schedule, "second", root)
    for rank in range(RANKS):
        assert resumed[rank]["iteration"] == whole[rank]["iteration"] == 6  # the step counter went on
        got, want = resumed[rank]["state"], whole[rank]["state"]
        assert sorted(got) == sorted(want)
        assert [k for k, v in got.items() if not torch.equal(v, want[k])] == []
    assert resumed[RANKS - 1]["losses"] == whole[RANKS - 1]["losses"][3:]
    assert all(len(step) > 0 for step in resumed[RANKS - 1]["losses"])
