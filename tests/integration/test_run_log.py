"""The run log: per-step records go straight to it, a few lines at a time, and none is lost at the end."""

from __future__ import annotations

import subprocess
import sys

from vpipe import log as run_log
from vpipe.log import DECISIONS, STEPS, RunLogHandler, decision, read_log, step_record


def test_step_records_are_whole_lines_in_order_around_decisions(tmp_path):
    path = tmp_path / "run.log"
    run_log.configure(path, rank=1)
    try:
        for step in range(RunLogHandler.STEP_BATCH + 3):  # one batch written, three waiting
            step_record(step, 0.01 * (step + 1), stage=1, micro_batches=4, layers=4)
        waiting = [r["step"] for r in read_log(path) if r["logger"] == STEPS]
        assert waiting == list(range(RunLogHandler.STEP_BATCH))
        decision("plan", "epoch 1", epoch=1)  # a decision flushes what waits
        step_record(99, 0.5, stage=1)
    finally:
        run_log.configure(None)  # closing writes the rest
    records = read_log(path)
    steps = [r for r in records if r["logger"] == STEPS]
    assert [r["step"] for r in steps] == list(range(RunLogHandler.STEP_BATCH + 3)) + [99]
    assert steps[0] == {**steps[0], "rank": 1, "level": "INFO", "step_s": 0.01, "stage": 1,
                        "micro_batches": 4,
                        "layers": 4, "msg": "step 0 took 0.0100 s"}
    assert [r["event"] for r in records if r["logger"] == DECISIONS] == ["plan"]
    assert len(path.read_text().splitlines()) == len(records)  # every line a record


def test_a_process_that_ends_without_closing_the_log_still_writes_its_last_steps(tmp_path):
    path = tmp_path / "run.log"
    code = (f"from vpipe import log\nlog.configure({str(path)!r}, rank=0)\n"
            "for step in range(3):\n    log.step_record(step, 0.1)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert [r["step"] for r in read_log(path) if r["logger"] == STEPS] == [0, 1, 2]
