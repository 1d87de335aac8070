"""The exact oracle equals brute force, memory limits included, and names infeasible layers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.graphs import all_cuts, chain, dags
from vpipe.graph import LayerGraph
from vpipe.planner.cost_model import CoarseCosts, GraphProfile, Hardware, PipelineSetup, StageCosts
from vpipe.planner.cuts import InfeasibleError
from vpipe.planner.exact import _lower_bound, exact_partition, min_bottleneck


def _brute_force(costs: StageCosts, p: int, budgets: np.ndarray, memory: str = "fixed"):
    """(best bottleneck, least bytes among the best) over every contiguous partition that fits."""
    mem = costs.memory if memory == "fixed" else costs.best_case_memory
    best = None
    for cuts in all_cuts(costs.n, p):
        b = [0, *cuts, costs.n]
        if any(mem(b[k], b[k + 1], k) > budgets[k] for k in range(p)):
            continue
        key = (float(costs.stage_times(cuts).max()), costs.comm_bytes(cuts))
        if best is None or key[0] < best[0] * (1 - 1e-9) or (key[0] <= best[0] * (1 + 1e-9)
                                                             and key[1] < best[1]):
            best = key
    return best


@st.composite
def problems(draw: st.DrawFn):
    graph = draw(dags(min_nodes=1, max_nodes=8))
    p = draw(st.integers(1, len(graph)))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "pipedream"]))
    hw = Hardware(copy_bytes_per_s=draw(st.floats(1e8, 1e11)), net_bytes_per_s=draw(st.floats(1e8, 1e11)))
    setup = PipelineSetup(p, schedule, draw(st.integers(1, 6)), hw)
    profile = GraphProfile(graph)
    codes = np.array(draw(st.lists(st.integers(0, 2), min_size=profile.n, max_size=profile.n)), dtype=np.int8)
    costs = StageCosts(profile, setup, codes)
    whole = float(costs.memory(0, costs.n, 0))
    budgets = np.array([draw(st.one_of(st.just(np.inf), st.floats(0.0, whole + 1))) for _ in range(p)])
    return costs, p, budgets


@settings(max_examples=150, deadline=None)
@given(problems(), st.sampled_from(["fixed", "best_case"]))
def test_exact_oracle_equals_brute_force(problem, memory):
    costs, p, budgets = problem
    expected = _brute_force(costs, p, budgets, memory)
    if expected is None:
        with pytest.raises(InfeasibleError, match="^infeasible: "):
            exact_partition(costs, p, budgets, memory=memory)
        return
    got = exact_partition(costs, p, budgets, memory=memory)
    # the DP's first limit is below the optimum
    assert _lower_bound(costs, p) <= expected[0] * (1 + 1e-9) + 1e-15
    assert got.bottleneck_s == pytest.approx(expected[0], rel=1e-9, abs=1e-15)
    assert costs.comm_bytes(got.cuts) == pytest.approx(expected[1], rel=1e-9, abs=1)
    bounds = [0, *got.cuts, costs.n]
    assert all(bounds[k] < bounds[k + 1] for k in range(p))
    mem = costs.memory if memory == "fixed" else costs.best_case_memory
    assert all(mem(bounds[k], bounds[k + 1], k) <= budgets[k] for k in range(p))


def test_a_layer_that_fits_no_stage_is_named():
    g = chain([1.0] * 6, act=1_000, param=1_000)
    big = g.nodes[3]
    nodes = [*g.nodes[:3], replace(big, name="huge", param_bytes=10**9), *g.nodes[4:]]
    costs = StageCosts(GraphProfile(LayerGraph("g", nodes, g.edges)), PipelineSetup(3))
    # Adam: 3 x 1 GB of parameter state, plus one copy of its 1 kB activation
    expected = rf"^infeasible: layer {big.id} \(huge\) needs 3000001000 bytes > budget 100000$"
    with pytest.raises(InfeasibleError, match=expected):
        exact_partition(costs, 3, np.full(3, 100_000.0), memory="best_case")


def test_layers_that_fit_alone_but_not_together_are_reported():
    g = chain([1.0] * 4, act=0, param=1000)  # 3 kB per layer with Adam
    costs = StageCosts(GraphProfile(g), PipelineSetup(2))
    with pytest.raises(InfeasibleError, match="fits some stage alone, but not all of them together"):
        exact_partition(costs, 2, np.full(2, 4000.0))
    assert min_bottleneck(costs, 2, np.full(2, 4000.0)) is None
    assert exact_partition(costs, 2, np.full(2, 6000.0)).cuts == (2,)


def test_stage_counts_are_checked():
    costs = StageCosts(GraphProfile(chain([1.0] * 3)), PipelineSetup(4))
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        exact_partition(costs, 4)
    with pytest.raises(ValueError, match="positive integer"):
        exact_partition(costs, 0)


def test_min_comm_variant_prefers_cheap_boundaries_among_equal_bottlenecks():
    # a 0.5 ms layer between two pairs of 2 ms layers: either split has a 4.5 ms slowest stage,
    # but the boundary after it carries 9 bytes, the one before it 1000 bytes
    g = chain([2.0, 2.0, 0.5, 2.0, 2.0], edge=9)
    edges = list(g.edges)
    edges[1] = (edges[1][0], edges[1][1], 1000)
    g = LayerGraph(g.name, g.nodes, edges)
    costs = StageCosts(GraphProfile(g), PipelineSetup(2, hardware=Hardware(net_bytes_per_s=1e15)))
    assert exact_partition(costs, 2, min_comm=True).cuts == (3,)
    assert costs.comm_bytes((3,)) == 9


@settings(max_examples=60, deadline=None)
@given(problems(), st.data())
def test_a_coarse_view_prices_partitions_on_its_positions_exactly(problem, data):
    costs, p, _ = problem
    inner = data.draw(st.lists(st.integers(1, max(1, costs.n - 1)), unique=True)) if costs.n > 1 else []
    positions = np.array(sorted({0, costs.n, *inner}))
    view = CoarseCosts(costs, positions)
    q = min(p, view.n)
    cuts = sorted(data.draw(st.lists(st.integers(1, view.n - 1), min_size=q - 1, max_size=q - 1,
                                     unique=True))) \
        if view.n > 1 else []
    full = view.full_cuts(cuts)
    assert np.allclose(view.stage_times(cuts), costs.stage_times(full))
    assert view.comm_bytes(cuts) == costs.comm_bytes(full)
    bounds, full_bounds = [0, *cuts, view.n], [0, *full, costs.n]
    for k in range(len(bounds) - 1):
        assert view.memory(bounds[k], bounds[k + 1], k) == pytest.approx(
            costs.memory(full_bounds[k], full_bounds[k + 1], k))
    with pytest.raises(ValueError, match="rise strictly from 0"):
        CoarseCosts(costs, positions[1:] if positions.size > 2 else np.array([0, 0]))
