"""Uneven devices in the planner: per-stage speeds fitted from
measured blocks, and partitions priced with them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vpipe.graph import LayerGraph, LayerNode
from vpipe.planner.cost_model import GraphProfile, Hardware, PipelineSetup, StageCosts
from vpipe.planner.speeds import describe_speeds, fit_stage_speeds, steady_speeds
from vpipe.planner.srp import fastest_step, plan_pipeline
from vpipe.planner.uneven import uneven_partition


def _graph(rng: np.random.Generator, n: int) -> LayerGraph:
    nodes = [LayerNode(id=i, name=str(i), fwd_s=float(rng.uniform(0.1, 1.0)),
                       bwd_s=float(rng.uniform(0.1, 2.0)),
                       act_bytes=1000, param_bytes=1000, order=i) for i in range(n)]
    edges = [(i, i + 1, int(rng.integers(1, 10**9))) for i in range(n - 1)]
    return LayerGraph(name="g", nodes=nodes, edges=edges)


@pytest.mark.parametrize("seed", range(12))
def test_the_uneven_partition_is_the_best_split_when_each_stage_is_priced_on_its_device(seed):
    rng = np.random.default_rng(seed)
    n, p = int(rng.integers(4, 11)), int(rng.integers(2, 5))
    graph = _graph(rng, n)
    speeds = tuple(float(s) for s in rng.uniform(1.0, 3.0, p))
    costs = StageCosts(GraphProfile(graph), PipelineSetup(p, hardware=Hardware(), stage_speeds=speeds))
    found = uneven_partition(costs, p, np.full(p, np.inf))
    brute = min(float(costs.stage_times(list(cuts)).max())
                for cuts in itertools.combinations(range(1, n), p - 1))
    assert found is not None and found.bottleneck_s == pytest.approx(brute, rel=1e-9)
    assert plan_pipeline(graph, p, stage_speeds=speeds).bottleneck_s == pytest.approx(brute, rel=1e-9)


def test_a_slower_stage_gets_fewer_blocks_and_the_lower_bound_knows_it():
    nodes = [LayerNode(id=i, name=str(i), fwd_s=1.0, bwd_s=2.0, act_bytes=0, param_bytes=0, order=i)
             for i in range(8)]
    graph = LayerGraph(name="even", nodes=nodes, edges=[(i, i + 1, 0) for i in range(7)])
    assert [len(s) for s in plan_pipeline(graph, 2).stages] == [4, 4]
    result = plan_pipeline(graph, 2, stage_speeds=[1.0, 2.0])
    assert [len(s) for s in result.stages] == [5, 3]  # 5 x 3 s against 3 x 3 s x 2
    setup = PipelineSetup(2, micro_batches=1, stage_speeds=(1.0, 2.0))
    assert fastest_step(GraphProfile(graph), setup) <= result.step_s


@pytest.mark.parametrize("speeds", [(1.0,), (1.0, 0.0), (1.0, float("nan")), (1.0, -2.0), (1.0, True)])
def test_bad_stage_speeds_are_refused_by_name(speeds):
    with pytest.raises(ValueError, match="stage_speeds must give a positive finite factor for each of the 2"):
        PipelineSetup(2, stage_speeds=speeds)


def test_speeds_come_from_blocks_of_one_kind_on_different_stages():
    observations = [("block", 0, 1.0), ("block", 0, 1.02), ("block", 1, 2.0), ("block", 1, 1.98)]
    assert fit_stage_speeds(observations, 2) == pytest.approx((1.0, 1.99 / 1.01), rel=1e-3)
    # a stage holding no kind another stage holds cannot be compared: it keeps 1.0
    assert fit_stage_speeds([("a", 0, 1.0), ("b", 1, 5.0)], 2) == (1.0, 1.0)


def test_speeds_come_from_a_block_measured_before_and_after_it_moved():
    # every block its own kind; block 7 ran on stage 1 at 3 s and on stage 0 at 2 s
    observations = [(("block", i), i // 4, 1.0 + i) for i in range(8)] + [(("moved", 7), 1, 3.0),
                                                                          (("moved", 7), 0, 2.0)]
    assert fit_stage_speeds(observations, 2) == (1.0, 1.5)


def test_small_differences_are_noise_and_several_kinds_agree():
    assert fit_stage_speeds([("a", 0, 1.0), ("a", 1, 1.1)], 2) == (1.0, 1.0)
    observations = [("a", 0, 1.0), ("a", 1, 1.5), ("b", 0, 4.0), ("b", 1, 6.0), ("b", 2, 12.0)]
    assert fit_stage_speeds(observations, 3) == (1.0, 1.5, 3.0)


def test_the_log_line_names_the_slow_stages_against_the_fastest():
    assert describe_speeds((1.0, 1.9)) == "stage 1 runs its blocks 1.9x slower than stage 0"
    assert describe_speeds((1.5, 1.0, 1.0)) == "stage 0 runs its blocks 1.5x slower than stage 1"
    assert describe_speeds((1.0, 1.0)) == "the stages run their blocks at the same speed"


def test_a_stage_is_as_slow_as_it_was_in_every_recent_sample():
    busy = [(1.0, 1.6), (1.0, 1.0), (1.5, 1.0)]  # a busy core slowed one stage now and then
    assert steady_speeds(busy, 2) == (1.0, 1.0)
    slow = [(1.0, 2.1), (1.0, 1.9), (1.1, 2.2)]  # a slower device: every sample
    assert steady_speeds(slow, 2) == (1.0, 2.0)  # the median of the samples that saw it slower
    assert steady_speeds(slow[:2], 2) == (1.0, 1.0)  # too few samples to say


def test_a_stage_less_than_strongly_slower_must_stay_so_twice_as_long():
    # ranks sharing cores, three samples in a row
    shared = [(1.0, 1.0)] * 3 + [(1.0, 1.4), (1.0, 1.35), (1.0, 1.45)]
    assert steady_speeds(shared, 2) == (1.0, 1.0)
    assert steady_speeds(shared[3:], 2) == (1.0, 1.0)  # three samples alone do not say it either
    steady = [(1.0, 1.5), (1.0, 1.45), (1.0, 1.55)] * 2  # a 1.5x slower device: every sample of six
    assert steady_speeds(steady, 2) == (1.0, 1.5)
    strong = [(1.0, 1.0)] * 3 + [(1.0, 2.0), (1.0, 2.1), (1.0, 1.9)]  # 2x: three samples suffice
    assert steady_speeds(strong, 2) == (1.0, 2.0)


def test_a_slow_device_stays_slow_through_a_sample_that_a_busy_fast_stage_made_look_even():
    """Stage 0 preempted in one sample makes stage 1's 2x device look 1.1x there: most of the window still
    says 2x, and the factor is their median (the least sample moved blocks back towards the slow stage)."""
    noisy = [(1.0, 2.4), (1.0, 2.1), (1.0, 1.6), (1.0, 2.2), (1.0, 2.0), (1.9, 2.1)]
    assert steady_speeds(noisy, 2) == (1.0, 2.1)
    recovered = [(1.0, 2.0)] * 3 + [(1.0, 1.0)] * 3  # without a pulse's alert, half the window says even
    assert steady_speeds(recovered, 2) == (1.0, 1.0)
