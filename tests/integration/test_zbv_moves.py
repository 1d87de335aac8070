"""Blocks leave the last stage of a V-shaped zero-bubble pipeline whose stages have Hugging Face's shape.

tests/workers/zbv_worker.py runs ``ScheduleZBVZeroBubble`` on two real ranks (stages 0 and 3 on rank 0), each
stage a wrapper module calling ``self.h``, a ModuleList of blocks, in a loop, the last with ``ln_f`` and a
head whose 3-d output is a view. torch cannot detach such an output in place, so after every step the last
stage's ``output_chunks`` keep its autograd graph, and with it the saved tensors of the nodes only the
input-gradient pass ran, until the next step begins. Every micro-batch's backward has run by then: the
tensor managers must hold nothing at the step boundary (no live saved storage, no host pool bytes), so the
forced plans that move swapped, recomputed and kept blocks out of that stage apply, and the losses are
bitwise those of the same trainer without vpipe.
"""

from __future__ import annotations

import pytest

from support.processes import run_worker


@pytest.mark.parametrize("scenario", ["swap_recompute", "keep"])
def test_blocks_leave_the_last_stage_of_a_modulelist_zbv_pipeline(tmp_path, scenario):
    result = run_worker(tmp_path, "zbv_worker", scenario, 2)
    applied = [r for r in result["log"] if r.get("event") == "plan_applied"]
    moved = [layers for r in result["log"] if r.get("event") == "migration_done" for layers in r["moved"]]
    assert applied and moved, "the forced plans must have applied and moved blocks"
    want = {"swap_recompute": [[0, 1], [2, 3], [4, 5, 6], [7]], "keep": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert result["placement"] == want[scenario]
    # at every step boundary, after every micro-batch's input and weight passes: nothing held for a backward
    assert all(row["live"] == 0 and row["host_pool"] == 0 and row["resident"] == 0
               for row in result["left"]), \
        [row for row in result["left"] if row["live"] or row["host_pool"] or row["resident"]]
    assert len(result["losses"]["plain"]) == 8 * 4  # 8 steps of 4 micro-batches
    assert result["losses"]["vpipe"] == result["losses"]["plain"]  # bitwise, every micro-batch of every step
