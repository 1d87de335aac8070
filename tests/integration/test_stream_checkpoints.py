"""vpipe's checkpoints under the streams that update once a period: PipeDream-2BW and WPipe on two real gloo
ranks (tests/workers/stream_checkpoint_worker.py). A run flushes after step 3, saves with
``vpipe.checkpoint.save_checkpoint`` and stops; fresh processes restore it, attach vpipe, load its state and
train to step 6: weights and losses bitwise those of a run that flushed at step 3 and went on."""

from __future__ import annotations

import pytest
import torch

from support.processes import WORKERS, run_ranks

RANKS = 2


def _run(tmp, schedule: str, part: str, root) -> dict[str, list[dict]]:
    """The launch of ``part`` (see the worker): each of its runs, each rank's."""
    out = tmp / f"{schedule}-{part}"
    run_ranks([str(WORKERS / "stream_checkpoint_worker.py"), schedule, part, str(root), str(out)], RANKS,
              tmp / f"{schedule}-{part}.txt")
    ranks = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(RANKS)]
    for runs in ranks:
        for run in runs.values():
            run["state"] = dict(run["state"])
    return {name: [ranks[r][name] for r in range(RANKS)] for name in ranks[0]}


@pytest.mark.timeout(600)  # three runs in two launches on two ranks
@pytest.mark.parametrize("schedule", ["2bw", "wpipe"])
def test_a_stream_saved_after_a_flush_resumes_in_fresh_processes_bitwise(tmp_path, schedule):
    root = tmp_path / "ck"
    whole = _run(tmp_path, schedule, "first", root)["whole"]
    resumed = _run(tmp_path, schedule, "second", root)["second"]
    for rank in range(RANKS):
        assert resumed[rank]["iteration"] == whole[rank]["iteration"] == 6  # the step counter went on
        got, want = resumed[rank]["state"], whole[rank]["state"]
        assert sorted(got) == sorted(want)
        assert [k for k, v in got.items() if not torch.equal(v, want[k])] == []
    assert resumed[RANKS - 1]["losses"] == whole[RANKS - 1]["losses"][3:]
    assert all(len(step) > 0 for step in resumed[RANKS - 1]["losses"])
    # before the flush the state is refused in one line: what the stream holds in flight is in no checkpoint
    said = {"2bw": "a checkpoint on a PipeDream-2BW stream needs schedule.flush() first "
                   "(1 micro-batch in flight)",
            "wpipe": "a checkpoint on a WPipe stream needs schedule.flush() first (period 5 in flight on G0)"}
    assert whole[0]["refused"] == said[schedule]
