"""A move whose state cannot travel, or cannot be loaded where it lands, is refused before it commits.

Ranks of :mod:`test_migration_layer_manager` (layer managers on threads, fake peers): the
refusal is one ``migration_refused`` line naming the layers and why, the round aborts on
both ranks at once (no timeout), and every stage keeps its blocks and optimizer state.
"""

from __future__ import annotations

import logging
import time

import torch

from support.migration import TWO, WAIT_S, Hub, Rank, assert_unchanged, placement_snapshot, run_ranks
from vpipe.migration.moves import Move
from vpipe.plan import Plan


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if getattr(r, "vpipe_fields", {}).get("event") == "migration_refused"]


def test_optimizer_state_that_cannot_travel_is_refused_by_the_source_and_nothing_moves(caplog):
    hub = Hub(2)
    ranks = [Rank(0, TWO, [0, 1], hub), Rank(1, TWO, [0, 1], hub)]
    keys, params, states = placement_snapshot(ranks)
    moved = next(iter(ranks[0].block(2).parameters()))
    ranks[0].optimizer.state[moved]["schedule"] = object()  # neither a tensor nor a plain value
    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="vpipe"):
        reports = run_ranks(ranks, Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5))))
    assert time.perf_counter() - start < WAIT_S / 2  # the target hears the refusal, it does not time out
    assert all(r.moved == [] and r.aborted == [Move(0, 1, (2,))] for r in reports)
    del ranks[0].optimizer.state[moved]["schedule"]
    assert_unchanged(ranks, keys, params, states)
    assert _refusals(caplog) == ["stage 0 cannot send layers [2]: cannot migrate optimizer state 'schedule' "
                                 "of fc.weight: a object is neither a tensor nor a plain value"]


def test_a_state_the_target_cannot_load_aborts_the_move_before_the_source_drops_it(caplog):
    hub = Hub(2)
    ranks = [Rank(0, TWO, [0, 1], hub), Rank(1, TWO, [0, 1], hub)]
    # the moving block's parameters sit in a second param group on the source only
    source = ranks[0].optimizer
    block_params = list(ranks[0].block(2).parameters())
    source.param_groups[0]["params"] = [p for p in source.param_groups[0]["params"]
                                        if all(p is not q for q in block_params)]
    source.add_param_group({"params": block_params, "lr": 0.001})
    keys, params, states = placement_snapshot(ranks)
    with caplog.at_level(logging.INFO, logger="vpipe"):
        reports = run_ranks(ranks, Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5))))
    assert all(r.moved == [] and r.aborted == [Move(0, 1, (2,))] for r in reports)
    assert_unchanged(ranks, keys, params, states)
    assert [torch.equal(p, q) for p, q in zip(ranks[0].block(2).parameters(), block_params)] == [True, True]
    assert _refusals(caplog) == ["stage 1 cannot load layers [2]: layer 2's fc.weight trains in param group "
                                 "1 on its stage; no param group here has its settings (the closest, group "
                                 "0, has lr 0.01 (not 0.001)): give every stage's optimizer groups with the "
                                 "same settings, named alike where they are named"]
