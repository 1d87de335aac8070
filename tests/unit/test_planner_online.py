"""The online planner: live records in, plans out; what the records
say about a stage is what it plans with."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vpipe.monitors.records import LayerRecord, StageRecord
from vpipe.plan import PINNED_KIND, Plan, Policy
from vpipe.planner.online import OnlineConfig, OnlinePlanner
from vpipe.planner.proposals import placeable_partitions as _placeable
from vpipe.planner.speeds import pooled_costs as _pooled

IDS = ([0, 1, 2, 3], [4, 5, 6, 7])
FOUR_FOUR = Plan(epoch=0, stages=((0, 1, 2, 3), (4, 5, 6, 7)))


def _stage(index: int, ids: list[int], iteration: int, slow: float = 1.0, kind: str = "", epoch: int = 0,
           **outside) -> StageRecord:
    """Every layer 1 ms forward, 2 ms backward per micro-batch (times ``slow``), over 4 micro-batches."""
    layers = tuple(LayerRecord(lid, fwd_s=4e-3 * slow, bwd_s=8e-3 * slow, fwd_calls=4, bwd_calls=4,
                               activation_bytes=1 << 20, param_bytes=1 << 20, optimizer_bytes=2 << 20,
                               output_bytes=1 << 16, kind=kind) for lid in ids)
    return StageRecord(index, iteration, epoch, "cpu", 0.0, 0.1, layers, 8 << 20, 16 << 20, 0, 0, 0, 0, 0, 0,
                       0, 0.0,
                       0, 0.0, 0.0, None, None, None, **outside)


def _planner(**config) -> OnlinePlanner:
    """A planner that sends what one search proposes (``confirm_samples=1``) unless told otherwise."""
    return OnlinePlanner(OnlineConfig(**{"schedule": "1f1b", "micro_batches": 4, "warmup_samples": 1,
                                         "cooldown_steps": 0, "confirm_samples": 1, **config}))


def _costs(planner: OnlinePlanner, vector: list[StageRecord],
           current: Plan) -> dict[int, tuple[float, float]]:
    """Per layer, the (forward, backward) seconds per micro-batch of the graph the planner hands to SRP."""
    graph = planner._graph(current, {lr.layer_id: lr for rec in vector for lr in rec.layers})
    return {node.id: (node.fwd_s, node.bwd_s) for node in graph.nodes}


def plan_command(head_fwd_s: float) -> Plan | None:
    """What one search plans for a 4,4 split with a head on the last
    stage (sent at once: confirm_samples=1)."""
    planner = OnlinePlanner(OnlineConfig(schedule="1f1b", micro_batches=4, warmup_samples=1, cooldown_steps=0,
                                         confirm_samples=1))
    current = Plan(epoch=0, stages=((0, 1, 2, 3), (4, 5, 6, 7)))
    head = {"outside_fwd_s": head_fwd_s, "outside_bwd_s": 2 * head_fwd_s, "outside_calls": 4}
    return planner([_stage(0, [0, 1, 2, 3], 9), _stage(1, [4, 5, 6, 7], 9, **head)], current)


def test_a_heavy_head_on_the_last_stage_moves_blocks_towards_the_first():
    assert plan_command(0.0) is None  # four blocks each: balanced
    plan = plan_command(4 * 4e-3)  # a head that costs as much as four blocks
    assert plan is not None and [len(s) for s in plan.stages] in ([6, 2], [5, 3])
    assert plan.stages[0][:4] == (0, 1, 2, 3)  # blocks only; the head is not a layer that can move


def test_a_plan_for_speed_waits_until_the_next_sample_proposes_it_too():
    """One noisy sample on a busy machine must not move layers: the next search has to agree."""
    # 2; one sample a search
    planner = _planner(smoothing=1.0, confirm_samples=OnlineConfig().confirm_samples)

    # blocks of unknown kind keep their own times
    def vector(iteration: int, slow: float) -> list[StageRecord]:
        return [_stage(0, [0, 1, 2, 3], iteration), _stage(1, [4, 5, 6, 7], iteration, slow)]

    assert planner(vector(9, 1.6), FOUR_FOUR) is None  # proposed once: waits
    # it was noise: nothing to gain, the count starts again
    assert planner(vector(19, 1.0), FOUR_FOUR) is None
    assert planner(vector(59, 1.6), FOUR_FOUR) is None
    plan = planner(vector(69, 1.6), FOUR_FOUR)
    assert plan is not None and plan.reason.startswith("rebalance")  # two searches in a row proposed it


def test_a_head_slowed_on_some_samples_only_is_not_a_heavier_head():
    """The end stages' time outside their blocks has no twin blocks to pool with: a sample in which a busy
    core slowed the head is not a heavier head. The least of the last three samples counts; a head heavy on
    every sample is planned for at the usual pace (proposed, then confirmed by the next sample)."""
    planner = _planner(smoothing=1.0, confirm_samples=2)
    calm = 0.0
    for iteration, head in zip(range(9, 80, 10), (4.0, calm, 4.0, 4.0, calm, 4.0, 4.0, calm)):
        assert planner(_with_head(iteration, head), FOUR_FOUR) is None, iteration
    steady = _planner(smoothing=1.0, confirm_samples=2)
    assert steady(_with_head(9, 4.0), FOUR_FOUR) is None  # proposed: waits for the next sample
    plan = steady(_with_head(19, 4.0), FOUR_FOUR)
    assert plan is not None and [len(s) for s in plan.stages] in ([6, 2], [5, 3])


def _with_head(iteration: int, head_blocks: float) -> list[StageRecord]:
    """4,4 with a head on the last stage that costs ``head_blocks`` blocks."""
    head = {"outside_fwd_s": head_blocks * 4e-3, "outside_bwd_s": head_blocks * 8e-3, "outside_calls": 4}
    return [_stage(0, IDS[0], iteration), _stage(1, IDS[1], iteration, **head)]


def test_near_equal_plans_that_noise_alternates_between_are_one_imbalance_and_the_earlier_goes():
    """A head of 3.5 blocks' cost makes a search move two blocks (6,2), of three one (5,3): on a busy machine
    consecutive samples land on either side, and waiting for two identical proposals never moved anything."""
    planner = _planner(smoothing=1.0, confirm_samples=2)
    assert planner(_with_head(9, 3.5), FOUR_FOUR) is None  # 6,2 proposed: waits
    plan = planner(_with_head(19, 3.0), FOUR_FOUR)  # this search proposes 5,3; 6,2 still pays on this sample
    assert plan is not None and [len(s) for s in plan.stages] == [6, 2]
    assert plan.reason.startswith("rebalance: step 96.03 -> ")  # priced on the second sample (3.5: 102.03)


def test_an_earlier_plan_that_no_longer_pays_is_dropped_and_the_new_one_waits():
    planner = _planner(smoothing=1.0, confirm_samples=2)
    assert planner(_with_head(9, 6.0), FOUR_FOUR) is None  # 7,1 proposed
    # 7,1 would be slower than 4,4 now: 5,3 starts over
    assert planner(_with_head(19, 1.5), FOUR_FOUR) is None
    plan = planner(_with_head(29, 1.5), FOUR_FOUR)
    assert plan is not None and [len(s) for s in plan.stages] == [5, 3]


def _memory_plan(kept_bytes_per_mb: int) -> Plan | None:
    """4,4 under 1F1B, 22 MiB per stage: stage 0 holds 16 MiB of weights, gradients and Adam state and two
    micro-batches of four layers that each save 1 MiB, where consecutive layers may save one tensor."""
    planner = _planner(memory_budget=22 << 20)
    return planner([_stage(0, [0, 1, 2, 3], 9, kept_bytes_per_mb=kept_bytes_per_mb),
                    _stage(1, [4, 5, 6, 7], 9)],
                   FOUR_FOUR)


def test_a_stage_that_measured_it_fits_with_every_layer_kept_is_not_swapped_for_memory():
    # summed per layer, stage 0 needs 16 + 2 x 4 = 24 MiB: over the budget, something must go (at once: a plan
    # to fit memory is not confirmed first)
    unmeasured = _memory_plan(0)
    assert unmeasured is not None and unmeasured.reason.startswith("memory over budget")
    assert any(policy is not Policy.KEEP for policy in unmeasured.policies.values())
    # measured once per storage, a micro-batch keeps 3 MiB (the layers share 1 MiB): 16 + 2 x 3 = 22 MiB fits
    assert _memory_plan(3 << 20) is None
    # a measurement above the sum (it cannot be: timing noise, another
    # tensor) never makes a stage look smaller
    over = _memory_plan(5 << 20)
    assert over is not None and over.reason.startswith("memory over budget")


def _noisy_balanced(kinds: tuple[str, str], slow: float = 1.6, samples: int = 3) -> Plan | None:
    """4,4 of blocks whose second stage measured ``slow`` times as long, over ``samples`` samples."""
    planner = OnlinePlanner(OnlineConfig(schedule="1f1b", micro_batches=4, warmup_samples=1,
                                         cooldown_steps=0))
    current = Plan(epoch=0, stages=((0, 1, 2, 3), (4, 5, 6, 7)))
    plans = [planner([_stage(0, [0, 1, 2, 3], it, kind=kinds[0]),
                      _stage(1, [4, 5, 6, 7], it, slow, kind=kinds[1])],
                     current) for it in range(9, 10 * samples, 10)]
    return next((p for p in plans if p is not None), None)


def test_interchangeable_blocks_measured_a_little_unevenly_are_not_moved_on_noise():
    # same kind on both stages, 8% apart: inside the dead band of the stages' speeds, one cost, balanced
    assert _noisy_balanced(("Block#a1", "Block#a1"), slow=1.08) is None
    plan = _noisy_balanced(("Block#a1", "Wide#b2"))  # different kinds really differ: rebalanced
    assert plan is not None and [len(s) for s in plan.stages] == [5, 3]
    assert _noisy_balanced(("", "")) is not None  # blocks of unknown kind keep their own times


def test_a_stage_that_runs_the_same_blocks_slower_on_every_sample_is_a_slower_device():
    """Same kind on both stages, stage 1 60% slower on every sample: its device is slower (a
    straggler, an older GPU), so blocks leave it once three samples after the first
    (start-up) agree: a factor that many samples named is known, and its plan is not held for
    another search; the plan says how fast each stage runs."""
    assert _noisy_balanced(("Block#a1", "Block#a1"), samples=3) is None
    plan = _noisy_balanced(("Block#a1", "Block#a1"), samples=4)
    assert plan is not None and [len(s) for s in plan.stages] == [5, 3]
    assert plan.stage_speeds == (1.0, 1.6)


def test_blocks_within_one_stage_are_still_pooled():
    """One block of a stage measured slow (a preempted sample) does not make that block heavier: the stage's
    blocks of one kind share their median."""
    planner = OnlinePlanner(OnlineConfig(schedule="1f1b", micro_batches=4, warmup_samples=1,
                                         cooldown_steps=0))
    vector = [_stage(0, [0, 1, 2, 3], 9, kind="Block#a1"), _stage(1, [4, 5, 6, 7], 9, kind="Block#a1")]
    odd = dataclasses.replace(vector[1].layers[3], fwd_s=vector[1].layers[3].fwd_s * 3)
    vector[1] = dataclasses.replace(vector[1], layers=(*vector[1].layers[:3], odd))
    planner._observe(vector, FOUR_FOUR)
    costs = _costs(planner, vector, FOUR_FOUR)
    assert len({round(c[0], 12) for c in costs.values()}) == 1


def test_the_same_numbers_twice_are_planned_once_and_small_changes_do_not_count():
    planner = OnlinePlanner(OnlineConfig(schedule="1f1b", micro_batches=4, warmup_samples=1,
                                         cooldown_steps=0))
    current = Plan(epoch=0, stages=((0, 1, 2, 3), (4, 5, 6, 7)))
    assert planner([_stage(0, [0, 1, 2, 3], 9), _stage(1, [4, 5, 6, 7], 9)], current) is None
    searches = []
    propose = planner._srp.propose
    planner._srp.propose = lambda *a, **k: searches.append(a[2]) or propose(*a, **k)
    planner([_stage(0, [0, 1, 2, 3], 19), _stage(1, [4, 5, 6, 7], 19)], current)
    assert searches == []  # the same costs and plan as the last search: nothing to search
    planner([_stage(0, [0, 1, 2, 3], 24, slow=1.01), _stage(1, [4, 5, 6, 7], 24)], current)
    assert searches == []  # smoothed, stage 0 moved by 0.5%: under the 1% that counts as new
    planner([_stage(0, [0, 1, 2, 3], 29, slow=1.5), _stage(1, [4, 5, 6, 7], 29)], current)
    assert searches == [29]  # new numbers: searched again
    planner([_stage(0, [0, 1, 2, 3], 39, slow=1.5, epoch=1), _stage(1, [4, 5, 6, 7], 39, epoch=1)],
            Plan(epoch=1, stages=current.stages))
    assert searches == [29, 39]  # another plan runs (if with the same layers): searched again



# ---------------------------------------------------------------------- smoothing and what the graph carries
def test_per_layer_costs_are_an_exponential_average_of_the_samples():
    planner = _planner(warmup_samples=10, smoothing=0.5)  # never plans: only observes
    for iteration, slow in ((9, 1.0), (19, 3.0), (29, 1.0)):
        vector = [_stage(0, IDS[0], iteration, slow), _stage(1, IDS[1], iteration)]
        assert planner(vector, FOUR_FOUR) is None
    costs = _costs(planner, vector, FOUR_FOUR)
    # 1, then (1 + 3) / 2 = 2, then (2 + 1) / 2 = 1.5 times the base 1 ms / 2 ms
    assert costs[0] == pytest.approx((1.5e-3, 3e-3)) and costs[3] == pytest.approx((1.5e-3, 3e-3))
    assert costs[4] == pytest.approx((1e-3, 2e-3))


def test_with_smoothing_one_only_the_newest_sample_counts():
    planner = _planner(warmup_samples=10, smoothing=1.0)
    for iteration, slow in ((9, 5.0), (19, 2.0)):
        vector = [_stage(0, IDS[0], iteration, slow), _stage(1, IDS[1], iteration)]
        planner(vector, FOUR_FOUR)
    assert _costs(planner, vector, FOUR_FOUR)[0] == pytest.approx((2e-3, 4e-3))


def test_a_recomputed_layers_backward_is_counted_without_the_forward_it_reran():
    current = Plan(epoch=0, stages=FOUR_FOUR.stages, policies={5: Policy.RECOMPUTE})
    planner = _planner(warmup_samples=10)
    vector = [_stage(0, IDS[0], 9), _stage(1, IDS[1], 9)]
    planner(vector, current)
    costs = _costs(planner, vector, current)
    assert costs[5] == pytest.approx((1e-3, 1e-3)) and costs[4] == pytest.approx((1e-3, 2e-3))


def test_the_first_and_last_stages_modules_outside_their_blocks_weigh_on_their_first_and_last_layers():
    planner = _planner(warmup_samples=10)
    vector = [_stage(0, IDS[0], 9, outside_fwd_s=8e-3, outside_bwd_s=4e-3, outside_calls=4,
                     outside_param_bytes=7),
              _stage(1, IDS[1], 9, outside_fwd_s=4e-3, outside_bwd_s=0.0, outside_calls=4,
                     outside_param_bytes=5)]
    planner(vector, FOUR_FOUR)
    records = {lr.layer_id: lr for rec in vector for lr in rec.layers}
    nodes = {n.id: n for n in planner._graph(FOUR_FOUR, records).nodes}
    assert (nodes[0].fwd_s, nodes[0].bwd_s) == pytest.approx((3e-3, 3e-3))  # + 2 ms, + 1 ms per micro-batch
    assert (nodes[7].fwd_s, nodes[7].bwd_s) == pytest.approx((2e-3, 2e-3))
    assert (nodes[3].fwd_s, nodes[4].fwd_s) == pytest.approx((1e-3, 1e-3))
    assert nodes[0].param_bytes == (1 << 20) + 7 and nodes[7].param_bytes == (1 << 20) + 5
    assert nodes[1].param_bytes == 1 << 20


# ---------------------------------------------------------------------- pooling interchangeable blocks
def _record(lid: int, kind: str, act: int = 1, out: int = 1) -> LayerRecord:
    return LayerRecord(lid, 0.0, 0.0, 1, 1, act, 0, 0, out, kind=kind)


def test_interchangeable_blocks_share_the_median_of_their_costs():
    records = {0: _record(0, "A"), 1: _record(1, "A"), 2: _record(2, "A"),
               3: _record(3, "A", act=2),  # saves other bytes: not interchangeable
               4: _record(4, "A", out=2),  # sends other bytes: not interchangeable
               5: _record(5, ""), 6: _record(6, ""),  # unknown kind: their own times
               7: _record(7, "B")}  # alone of its kind
    costs = {0: [1.0, 10.0], 1: [2.0, 30.0], 2: [9.0, 20.0], 3: [4.0, 40.0], 4: [5.0, 50.0], 5: [6.0, 60.0],
             6: [7.0, 70.0], 7: [8.0, 80.0]}
    pooled = _pooled(list(range(8)), records, costs)
    # forward and backward medians, each on its own
    assert [pooled[lid] for lid in (0, 1, 2)] == [[2.0, 20.0]] * 3
    assert {lid: pooled[lid] for lid in range(3, 8)} == {lid: costs[lid] for lid in range(3, 8)}
    assert costs[0] == [1.0, 10.0]  # the smoothed costs themselves are left alone


# ---------------------------------------------------------------------- which vectors count
def test_a_vector_measured_under_an_older_plan_is_not_a_sample_of_the_current_one():
    def vector(iteration: int, epoch: int) -> list[StageRecord]:
        return [_stage(0, IDS[0], iteration, slow=3.0, epoch=epoch),
                _stage(1, IDS[1], iteration, epoch=epoch)]

    current = Plan(epoch=1, stages=FOUR_FOUR.stages)
    planner = _planner(warmup_samples=2)
    assert planner(vector(9, epoch=0), current) is None  # measured before epoch 1 took effect: not counted
    assert planner(vector(19, epoch=1), current) is None  # the first sample of two
    plan = planner(vector(29, epoch=1), current)
    assert plan is not None and plan.epoch == 2 and len(plan.stages[0]) < 4
    assert planner(vector(39, epoch=1)[:1], current) is None  # one record short of the plan's two stages
    assert planner(vector(49, epoch=1), None) is None  # no plan known yet


def test_after_a_layer_edit_the_planner_plans_the_placement_the_stages_report():
    """Layer 8 was added to stage 0 (epoch 1) by an edit the planner did not make: it plans nine layers."""
    current = Plan(epoch=0, stages=FOUR_FOUR.stages, policies={3: Policy.RECOMPUTE})
    vector = [_stage(0, [0, 1, 2, 3, 8], 9, epoch=1), _stage(1, IDS[1], 9, slow=0.5, epoch=1)]
    observed = OnlinePlanner._observed_placement(vector, current)
    assert (observed.epoch, observed.stages, observed.reason) == (1, ((0, 1, 2, 3, 8), (4, 5, 6, 7)),
                                                                  "observed")
    # the known layers keep their policies; the new one has none yet (kept)
    assert observed.policies == {lid: Policy.RECOMPUTE if lid == 3 else Policy.KEEP for lid in range(8)}
    # sent at once, even where plans for speed wait for a second sample: an edit is a known change, not noise
    plan = _planner(confirm_samples=2)(vector, current)
    assert plan is not None and plan.epoch == 2 and plan.layer_ids == [0, 1, 2, 3, 8, 4, 5, 6, 7]
    assert [len(s) for s in plan.stages] == [4, 5]  # stage 1 runs at half the cost per layer


@pytest.mark.parametrize("stage_ids, epochs", [
    (([0, 1, 2, 3, 8], IDS[1]), (1, 0)),  # one stage applied the edit, the other not yet
    (([0, 1, 2, 3, 4, 5, 6, 7], []), (1, 1)),  # a stage without layers cannot be planned
])
def test_a_vector_caught_mid_edit_is_not_planned(stage_ids, epochs):
    current = Plan(epoch=0, stages=FOUR_FOUR.stages)
    vector = [_stage(s, ids, 9, slow=3.0 if s == 0 else 1.0, epoch=e)
              for s, (ids, e) in enumerate(zip(stage_ids, epochs))]
    assert OnlinePlanner._observed_placement(vector, current) is None
    planner = _planner()
    assert planner(vector, current) is None and planner._samples == 0


# ---------------------------------------------------------------------- what the stages can build
def _builder(index: int, ids: list[int], kinds: list[str], builds: list[str] | None) -> StageRecord:
    layers = tuple(LayerRecord(lid, 0.1, 0.2, 1, 1, 0, 0, 0, 0, kind=k) for lid, k in zip(ids, kinds))
    return StageRecord(index, 0, 0, "cpu", 0.0, 1.0, layers, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0.0, 0.0,
                       None, None, None, builds=None if builds is None else tuple(builds))


def test_every_hop_of_a_move_must_land_on_a_stage_that_builds_the_layer():
    vector = [_builder(0, [0, 1], ["A", "B"], ["A", "B"]), _builder(1, [2], ["A"], ["A"]),
              _builder(2, [3], ["A"], ["A", "B"]), _builder(3, [4], ["A"], None)]
    current = Plan(epoch=0, stages=((0, 1), (2,), (3,), (4,)))
    placeable = _placeable(vector, current)
    assert placeable([[0, 1], [2], [3], [4]]) is True  # nothing moves
    assert placeable([[0], [1, 2], [3], [4]]) is False  # stage 1 cannot build a B block
    # nor let one through on its way to stage 2, which could
    assert placeable([[0], [1], [2, 3], [4]]) is False
    # A blocks back upstream: every stage on the way builds A
    assert placeable([[0, 1, 2, 3], [], [], [4]]) is True
    assert placeable([[0, 1], [2], [], [3, 4]]) is True  # stage 3 has a layer factory: it builds anything
    assert placeable([[0, 1], [2], [3], [4, 9]]) is True  # a layer no stage reported (new) moves nowhere
    vector[1] = _builder(1, [2], ["C"], ["A", "C"])  # a kind stage 0 cannot clone...
    assert _placeable(vector, current)([[0, 1, 2], [3], [4], []]) is False
    vector[0] = _builder(0, [0, 1], ["A", "B"], None)  # ... unless it has a layer factory
    assert _placeable(vector, current)([[0, 1, 2], [3], [4], []]) is True


def test_a_pinned_block_never_moves_even_to_a_stage_with_a_layer_factory():
    vector = [_builder(0, [0, 1], ["A", "A" + PINNED_KIND], None), _builder(1, [2, 3], ["A", "A"], None)]
    current = Plan(epoch=0, stages=((0, 1), (2, 3)))
    placeable = _placeable(vector, current)
    assert placeable([[0, 1, 2], [3]]) is True  # the blocks around it still move
    assert placeable([[0], [1, 2, 3]]) is False


# ---------------------------------------------------------------------- configuration
def test_the_configuration_goes_to_json_and_back():
    config = OnlineConfig(schedule="zbv", micro_batches=6, in_flight=[4, 2], stage_ranks=[0, 0],
                          smoothing=0.3,
                          in_flight_together=[[4, 0], [2, 2]])
    assert OnlineConfig.from_mapping(json.loads(json.dumps(config.to_dict()))) == config
    assert OnlineConfig.from_mapping({}) == OnlineConfig()


@pytest.mark.parametrize(
    "raw, message",
    [
        ("[1, 2]", "planner config must be a JSON object of OnlineConfig fields, got list"),
        (json.dumps({"smoothin": 0.5, "warmup": 1}), "planner config has unknown keys: smoothin, warmup"),
        (json.dumps({"smoothing": 0}), "planner config: smoothing must be in (0, 1], got 0"),
        (
            json.dumps({"schedule": "zb"}),
            "planner config: schedule must be one of gpipe, 1f1b, pipedream, pipedream2bw, interleaved1f1b",
        ),
        (
            json.dumps({"micro_batches": True}),
            "planner config: micro_batches must be a positive integer, got True",
        ),
        (
            json.dumps({"memory_budget": 0}),
            "planner config: memory_budget must be a positive number of bytes or null, got 0",
        ),
        (json.dumps({"min_gain": 1.0}), "planner config: min_gain must be in [0, 1), got 1.0"),
        (json.dumps({"warmup_samples": 0}), "planner config: warmup_samples must be >= 1, got 0"),
        (
            json.dumps({"confirm_samples": 0}),
            "planner config: confirm_samples must be a positive integer, got 0",
        ),
        (
            json.dumps({"in_flight": [2, 2]}),
            "planner config: in_flight and stage_ranks come together, one value per stage",
        ),
        (
            json.dumps({"in_flight": [2], "stage_ranks": [0, 0]}),
            "planner config: in_flight and stage_ranks come together",
        ),
        (
            json.dumps({"in_flight": [2, -1], "stage_ranks": [0, 0]}),
            "planner config: in_flight must be a list of non-negative integers or null, got [2, -1]",
        ),
        (
            json.dumps({"in_flight": [2, 2], "stage_ranks": [0, 0], "in_flight_together": [[1, 2, 3]]}),
            "planner config: in_flight_together must be null or rows of one non-negative integer per stage",
        ),
        (
            json.dumps({"schedule": "dualpipev"}),
            "planner config: schedule dualpipev runs several stages per rank: "
            "in_flight and stage_ranks are needed",
        ),
        (json.dumps({"net_bytes_per_s": 0}), "planner config: bandwidths must be positive"),
    ],
)
def test_a_bad_configuration_is_named(raw, message):
    with pytest.raises(ValueError) as err:
        OnlineConfig.from_mapping(json.loads(raw))
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("field", ["in_flight", "stage_ranks"])
@pytest.mark.parametrize("value", [0.0, False])
def test_counts_and_ranks_that_are_not_integers_are_refused(field, value):
    lists = {"in_flight": [2, 1], "stage_ranks": [0, 1], field: [1, value]}
    with pytest.raises(ValueError, match=f"{field} must be a list of non-negative integers or null"):
        OnlineConfig(schedule="zbv", **lists)


def _shared_rank_plan(kept: tuple[int, int, int, int], budget: int = 7 << 20,
                      together: list[list[int]] | None = None) -> Plan | None:
    """Interleaved 1F1B, 2 ranks x 2 stages of one layer each, 7 MiB per rank: stage 0
    needs 4 micro-batches of 1 MiB, stage 2 two of 0.5 MiB (rank 0: 5 MiB with
    everything kept); half the rank each would not hold stage 0."""
    planner = _planner(schedule="interleaved1f1b", memory_budget=budget, in_flight=[4, 3, 2, 1],
                       stage_ranks=[0, 1, 0, 1], allow_moves=False, in_flight_together=together)
    acts = (1 << 20, 1 << 20, 1 << 19, 1 << 19)
    vector = []
    for v in range(4):
        layer = LayerRecord(v, fwd_s=4e-3, bwd_s=8e-3, fwd_calls=4, bwd_calls=4, activation_bytes=acts[v],
                            param_bytes=1 << 10, optimizer_bytes=2 << 10, output_bytes=1 << 16)
        vector.append(StageRecord(v, 9, 0, "cpu", 0.0, 0.1, (layer,), 1 << 10, 2 << 10, 0, 0, 0, 0, 0, 0, 0,
                                  0.0,
                                  0, 0.0, 0.0, None, None, None, kept_bytes_per_mb=kept[v]))
    return planner(vector, Plan(epoch=0, stages=((0,), (1,), (2,), (3,))))


def test_a_ranks_stages_share_its_budget_by_what_they_need_to_keep_everything():
    plan = _shared_rank_plan((0, 0, 0, 0))  # not measured: equal halves, stage 0's 4 MiB does not fit 3.5
    assert plan is not None and plan.policy(0) is not Policy.KEEP
    assert _shared_rank_plan((1 << 20, 1 << 20, 1 << 19, 1 << 19)) is None  # measured: 5 MiB of the rank's 7


def test_a_ranks_stages_that_never_peak_together_keep_everything_where_the_plain_schedule_fits():
    kept = (1 << 20, 1 << 20, 1 << 19, 1 << 19)
    budget = 9 << 19  # 4.5 MiB: the stages' own peaks (4 + 1 MiB on rank 0) do not fit together...
    plan = _shared_rank_plan(kept, budget)
    assert plan is not None and plan.policy(0) is not Policy.KEEP
    # ... but the action lists say stage 0 holds 4 while stage 2 holds none, and 2 while it holds 2:
    # 4 MiB at most
    together = [[4, 3, 0, 1], [2, 1, 2, 1]]
    assert _shared_rank_plan(kept, budget, together) is None


def test_stages_on_a_cpu_are_planned_with_their_swap_copies_on_the_compute_thread():
    planner = _planner()
    planner([_stage(0, [0, 1, 2, 3], 9), _stage(1, [4, 5, 6, 7], 9)], FOUR_FOUR)
    assert planner._hardware.copies_overlap is False and planner._srp.setup.hardware.copies_overlap is False
    gpu = [dataclasses.replace(_stage(k, ids, 19), device="cuda:0") for k, ids in enumerate(FOUR_FOUR.stages)]
    planner(gpu, FOUR_FOUR)
    assert planner._hardware.copies_overlap is True  # CUDA copy streams run beside the compute


def test_a_move_is_weighed_against_what_the_last_move_measured():
    """The ranks say how long applying a move took (``move_s``); a later move whose gain over the horizon
    does not pay for that much time per byte is not made, however the link's bandwidth looks on paper."""
    planner = _planner(horizon_steps=10)
    head = {"outside_fwd_s": 4 * 4e-3, "outside_bwd_s": 8 * 4e-3, "outside_calls": 4}
    first = planner([_stage(0, [0, 1, 2, 3], 9), _stage(1, [4, 5, 6, 7], 9, **head)], FOUR_FOUR)
    assert first is not None and first.stages != FOUR_FOUR.stages
    # the move (8 MiB counted) took 2 s on the ranks: a quarter of a second per MiB
    moved = [_stage(0, list(first.stages[0]), 19, epoch=first.epoch, move_s=2.0),
             _stage(1, list(first.stages[1]), 19, epoch=first.epoch, **head)]
    planner(moved, first)
    assert planner._srp.measured_s_per_byte == pytest.approx(2.0 / _moved_bytes(first), rel=1e-6)
    # a MiB costs what it took, not 0.1 ms of link time
    assert planner._srp.move_s(1 << 20) == pytest.approx(0.25)
    # the head doubles: worth a move on paper, not at what moves cost here
    heavier = {k: 2 * v for k, v in head.items() if k != "outside_calls"} | {"outside_calls": 4}
    vector = [_stage(0, list(first.stages[0]), 29, epoch=first.epoch),
              _stage(1, list(first.stages[1]), 29, epoch=first.epoch, **heavier)]
    assert _planner(horizon_steps=10)(vector, first) is not None  # at the link's speed it would move
    assert planner(vector, first) is None


def _moved_bytes(plan: Plan) -> int:
    """Bytes the planner counts for the 4,4 -> ``plan`` move: per block and hop its 1 MiB of parameters
    and, at the records' 2 bytes of optimizer state per parameter byte, three times that again (the
    planner's optimizer factor counts the gradient too)."""
    moved = len(set(FOUR_FOUR.stages[0]) ^ set(plan.stages[0]))
    return moved * (1 << 20) * 4


def test_blocks_frozen_part_way_are_not_pooled_with_training_ones_and_the_split_follows():
    """Progressive freezing: stage 0's four blocks stop training, so their backward
    has no weight gradients and shrinks; same kind as stage 1's, but not
    interchangeable with them any more: blocks move to stage 0."""
    planner = _planner()

    def stage(index: int, ids: list[int], frozen: bool, epoch: int) -> StageRecord:
        rec = _stage(index, ids, 9 + 10 * epoch, kind="Block#a1", epoch=epoch)
        if not frozen:
            return rec
        layers = tuple(dataclasses.replace(lr, bwd_s=lr.bwd_s / 4, trainable=False) for lr in rec.layers)
        return dataclasses.replace(rec, layers=layers)

    assert planner([stage(0, [0, 1, 2, 3], False, 0), stage(1, [4, 5, 6, 7], False, 0)], FOUR_FOUR) is None
    # stage 0's pulse saw its trainable parameters change: the daemon had every rank measure again (epoch 1)
    planner.alerted(0, 1.0, 10)
    remeasured = dataclasses.replace(FOUR_FOUR, epoch=1)
    plan = planner([stage(0, [0, 1, 2, 3], True, 1), stage(1, [4, 5, 6, 7], False, 1)], remeasured)
    assert plan is not None and len(plan.stages[0]) > 4
    assert plan.stage_speeds in (None, (1.0, 1.0))  # a frozen block is lighter work, not a faster device


def _straggler_run(neighbour_alert_at: int) -> Plan | None:
    """Stage 1's device slows at step 12 (its pulse alerts, epoch 1); the sample at 15 sees it 2x slower;
    stage 0's pulse alerts at ``neighbour_alert_at`` (epoch 2), and the next sample comes 3 steps later.
    Returns what that sample sends (confirm_samples=2)."""
    planner = _planner(confirm_samples=2)
    for step in (9, 11):
        assert planner([_stage(0, IDS[0], step, kind="Block#a1"), _stage(1, IDS[1], step, kind="Block#a1")],
                       FOUR_FOUR) is None
    planner.alerted(1, 2.0, 12)
    slowed = dataclasses.replace(FOUR_FOUR, epoch=1)
    assert planner([_stage(0, IDS[0], 15, kind="Block#a1", epoch=1),
                    _stage(1, IDS[1], 15, slow=2.0, kind="Block#a1", epoch=1)], slowed) is None  # one sample
    planner.alerted(0, 1.4, neighbour_alert_at)
    again = dataclasses.replace(FOUR_FOUR, epoch=2)
    step = neighbour_alert_at + 3
    return planner([_stage(0, IDS[0], step, kind="Block#a1", epoch=2),
                    _stage(1, IDS[1], step, slow=2.0, kind="Block#a1", epoch=2)], again)


def test_a_neighbours_pulse_soon_after_a_slowdown_keeps_what_was_learnt_since():
    """The straggler of the dynamic benchmark: stage 0's pulse fired soon after stage 1 slowed (its waits
    changed with its neighbour). The sample measured after the slowdown is kept: with the next one, two
    samples agree on the new speeds and the plan for them goes at once (the alert and they confirmed it),
    instead of learning the factors again (ten steps lost)."""
    plan = _straggler_run(neighbour_alert_at=16)
    assert plan is not None and len(plan.stages[0]) > 4
    assert plan.stage_speeds == (1.0, 2.0)


def test_an_alert_later_than_the_samples_forgets_them():
    """Samples measured more than ``_ALERT_LAG`` steps before an alert may predate the change it reports: the
    factors are learnt again from the samples after it."""
    assert _straggler_run(neighbour_alert_at=30) is None


def test_a_plan_that_follows_a_freeze_goes_at_once_and_a_plan_on_noise_waits():
    """A pulse's freeze is a count of trainable parameters, never noise: the
    first plan after it is not held for a second search. The same costs without
    an alert wait for the next sample to propose the plan again."""
    def frozen(index: int, ids: list[int], step: int, epoch: int) -> StageRecord:
        rec = _stage(index, ids, step, kind="Block#a1", epoch=epoch)
        if index:
            return rec
        return dataclasses.replace(rec, layers=tuple(dataclasses.replace(lr, bwd_s=lr.bwd_s / 4,
                                                                         trainable=False)
                                                     for lr in rec.layers))

    results = []
    for alert in (True, False):
        planner = _planner(confirm_samples=2)
        assert planner([_stage(0, IDS[0], 9, kind="Block#a1"), _stage(1, IDS[1], 9, kind="Block#a1")],
                       FOUR_FOUR) is None
        current = FOUR_FOUR
        if alert:
            planner.alerted(0, 1.0, 10)
            current = dataclasses.replace(FOUR_FOUR, epoch=1)
        results.append(planner([frozen(0, IDS[0], 13, current.epoch), frozen(1, IDS[1], 13, current.epoch)],
                               current))
    assert results[0] is not None and len(results[0].stages[0]) > 4
    assert results[1] is None


def test_a_split_left_for_a_slower_device_is_taken_again_after_a_pulse_but_not_on_speeds_alone():
    """A straggler that recovers goes back to the split it left once a pulse reports the change; speeds
    learnt without one do not move it back (on shared cores a stage's factor measured on one block swings
    with the load, and a 2x rank went 4,4 -> 7,1 -> 4,4 -> 7,1 in CI when they did)."""
    results = []
    for pulse in (False, True):
        planner = _planner()
        current, step, plan = FOUR_FOUR, 9, None
        while plan is None and step < 40:
            plan = planner([_stage(0, IDS[0], step, kind="Block#a1"),
                            _stage(1, IDS[1], step, slow=2.0, kind="Block#a1")], current)
            step += 2
        assert plan is not None and len(plan.stages[0]) > 4 and plan.stage_speeds == (1.0, 2.0)
        current, back = plan, None
        if pulse:
            planner.alerted(1, 0.5, step)
            current = dataclasses.replace(current, epoch=current.epoch + 1)
        while back is None and step < 80:
            back = planner([_stage(0, list(current.stages[0]), step, kind="Block#a1", epoch=current.epoch),
                            _stage(1, list(current.stages[1]), step, kind="Block#a1", epoch=current.epoch)],
                           current)
            step += 2
        results.append(back)
    assert results[0] is None
    assert results[1] is not None and results[1].stages == FOUR_FOUR.stages
