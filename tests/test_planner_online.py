"""The online planner: live records in, plans out; what the records say about a stage is what it plans with."""

from __future__ import annotations

from vpipe.monitors.records import LayerRecord, StageRecord
from vpipe.planner.online import OnlineConfig, OnlinePlanner
from vpipe.plan import Plan


def _stage(index: int, ids: list[int], iteration: int, slow: float = 1.0, kind: str = "", **outside) -> StageRecord:
    layers = tuple(LayerRecord(lid, fwd_s=4e-3 * slow, bwd_s=8e-3 * slow, fwd_calls=4, bwd_calls=4,
                               activation_bytes=1 << 20, param_bytes=1 << 20, optimizer_bytes=2 << 20,
                               output_bytes=1 << 16, kind=kind) for lid in ids)
    return StageRecord(index, iteration, 0, "cpu", 0.0, 0.1, layers, 8 << 20, 16 << 20, 0, 0, 0, 0, 0, 0, 0, 0.0,
                       0, 0.0, 0.0, None, None, None, **outside)


def _plan(head_fwd_s: float) -> Plan | None:
    planner = OnlinePlanner(OnlineConfig(schedule="1f1b", micro_batches=4, warmup_samples=1, cooldown_steps=0))
    current = Plan(epoch=0, stages=((0, 1, 2, 3), (4, 5, 6, 7)))
    head = {"outside_fwd_s": head_fwd_s, "outside_bwd_s": 2 * head_fwd_s, "outside_calls": 4}
    return planner([_stage(0, [0, 1, 2, 3], 9), _stage(1, [4, 5, 6, 7], 9, **head)], current)


def test_a_heavy_head_on_the_last_stage_moves_blocks_towards_the_first():
    assert _plan(0.0) is None  # four blocks each: balanced
    plan = _plan(4 * 4e-3)  # a head that costs as much as four blocks
    assert plan is not None and [len(s) for s in plan.stages] in ([6, 2], [5, 3])
    assert plan.stages[0][:4] == (0, 1, 2, 3)  # blocks only; the head is not a layer that can move


def _noisy_balanced(kinds: tuple[str, str]) -> Plan | None:
    """4,4 of blocks whose second stage measured 60% slower (a busy core), over three samples."""
    planner = OnlinePlanner(OnlineConfig(schedule="1f1b", micro_batches=4, warmup_samples=1, cooldown_steps=0))
    current = Plan(epoch=0, stages=((0, 1, 2, 3), (4, 5, 6, 7)))
    plans = [planner([_stage(0, [0, 1, 2, 3], it, kind=kinds[0]), _stage(1, [4, 5, 6, 7], it, 1.6, kind=kinds[1])],
                     current) for it in (9, 19, 29)]
    return next((p for p in plans if p is not None), None)


def test_interchangeable_blocks_measured_unevenly_are_not_moved_on_noise():
    assert _noisy_balanced(("Block#a1", "Block#a1")) is None  # same kind, same bytes: one cost, balanced
    plan = _noisy_balanced(("Block#a1", "Wide#b2"))  # different kinds really differ: rebalanced
    assert plan is not None and [len(s) for s in plan.stages] == [5, 3]
    assert _noisy_balanced(("", "")) is not None  # blocks of unknown kind keep their own times


def test_the_same_numbers_twice_are_planned_once():
    planner = OnlinePlanner(OnlineConfig(schedule="1f1b", micro_batches=4, warmup_samples=1, cooldown_steps=0))
    current = Plan(epoch=0, stages=((0, 1, 2, 3), (4, 5, 6, 7)))
    assert planner([_stage(0, [0, 1, 2, 3], 9), _stage(1, [4, 5, 6, 7], 9)], current) is None
    searches = []
    propose = planner._srp.propose
    planner._srp.propose = lambda *a, **k: searches.append(a[2]) or propose(*a, **k)
    planner([_stage(0, [0, 1, 2, 3], 19), _stage(1, [4, 5, 6, 7], 19)], current)
    assert searches == []  # the same costs and plan as the last search: nothing to search
    planner([_stage(0, [0, 1, 2, 3], 29, slow=1.5), _stage(1, [4, 5, 6, 7], 29)], current)
    assert searches == [29]  # new numbers: searched again
