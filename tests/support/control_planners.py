"""Planners for the control-plane tests; the daemon imports them by path (tests/ is put on PYTHONPATH).

``record_and_mark`` appends every stats vector it gets to ``$VPIPE_TEST_PLANNER_OUT`` (one
JSON object per line) and answers each with a marker plan: the current placement under
the next epoch, its reason naming the iteration, so every stage can show it got it.
"""

from __future__ import annotations

import json
import os

from vpipe.monitors.records import StageRecord
from vpipe.plan import Plan, Policy


def record_and_mark(vector: list[StageRecord], current: Plan | None) -> Plan:
    iteration = vector[0].iteration
    with open(os.environ["VPIPE_TEST_PLANNER_OUT"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"pid": os.getpid(), "iteration": iteration,
                            "records": [r.to_wire() for r in vector]}) + "\n")
    stages = current.stages if current else tuple(tuple(r.layer_ids) for r in vector)
    return Plan(epoch=(current.epoch if current else 0) + 1, stages=stages, reason=f"marker {iteration}")


def failing(vector: list[StageRecord], current: Plan | None) -> Plan:
    raise RuntimeError("this planner always fails")


def reordering(vector: list[StageRecord], current: Plan | None) -> Plan:
    """A buggy planner: the right layers and stage sizes, the first two layers swapped."""
    order = [lid for r in vector for lid in r.layer_ids]
    order[0], order[1] = order[1], order[0]
    counts = [len(r.layer_ids) for r in vector]
    return Plan.from_counts(order, counts, epoch=(current.epoch if current else 0) + 1)


def slower_from_the_sixth(vector: list[StageRecord], current: Plan | None) -> Plan | None:
    """A bad planner: from its sixth vector on, whenever the pipeline does not run it yet, every layer
    but the last on stage 0, all recomputed. (Not sooner: the steps the judge compares it with must come
    after the start-up of whatever else runs on the cores; a busy start made the steps before as slow as
    the bad plan's, and the judge rightly kept it.)"""
    global _CALLS
    _CALLS += 1
    if _CALLS < 6 or current is None:
        return None
    order = [lid for r in vector for lid in r.layer_ids]
    counts = [len(order) - len(vector) + 1] + [1] * (len(vector) - 1)
    stages = Plan.from_counts(order, counts).stages
    if current.stages == stages:
        return None
    return Plan(epoch=current.epoch + 1, stages=stages, policies={lid: Policy.RECOMPUTE for lid in order},
                reason="rebalance (a bad one, on purpose)")


_CALLS = 0
