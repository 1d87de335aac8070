"""optimize_sr (Alg. 2): fits the budget, and no single-layer policy change beats it."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from support.graphs import chain, dags
from vpipe.graph import LayerGraph, LayerNode
from vpipe.plan import Policy
from vpipe.planner.cost_model import Hardware, stage_memory, stage_time
from vpipe.planner.sr import optimize_sr

D, S, R = Policy.KEEP, Policy.SWAP, Policy.RECOMPUTE
SETUP = dict(stage=0, num_stages=4, schedule="1f1b", micro_batches=8)


def _memory(graph: LayerGraph, policies: dict, hardware: Hardware) -> float:
    return stage_memory(graph, graph.ids, policies, hardware=hardware, **SETUP)


def test_without_a_budget_every_layer_keeps_its_activations():
    g = chain([1.0, 2.0, 3.0])
    result = optimize_sr(g, g.ids, **SETUP)
    assert set(result.policies.values()) == {D}
    assert result.fits and result.stage_time_s == pytest.approx(stage_time(g, g.ids))


def test_free_swaps_come_first_and_stop_once_the_budget_holds():
    # three layers of 6 ms compute each; each swap moves 2 MB over a 1 GB/s link = 2 ms, hidden in the window
    g = chain([6.0, 6.0, 6.0], act=1_000_000, param=0)
    hw = Hardware(copy_bytes_per_s=1e9)
    keep_all = _memory(g, {}, hw)  # 4 in flight x 3 MB
    result = optimize_sr(g, g.ids, memory_budget=keep_all - 2_500_000, hardware=hw, **SETUP)
    # one swap saves 3 MB (4 copies -> 1): exactly one layer swapped, nothing recomputed, no time added
    assert sorted(p.value for p in result.policies.values()) == ["D", "D", "S"]
    assert result.stage_time_s == pytest.approx(stage_time(g, g.ids, hardware=hw))


def test_recompute_is_chosen_where_it_is_cheaper_than_an_exposed_swap():
    # a cheap layer with a huge activation and a small input: recompute costs 0.1 ms, swap 200 ms
    nodes = [LayerNode(1, "in", 0.0, 0.0, 1000, 0, 0), LayerNode(2, "big", 1e-4, 2e-4, 100_000_000, 0, 1)]
    g = LayerGraph("g", nodes, [(1, 2, 1000)])
    hw = Hardware(copy_bytes_per_s=1e9)
    result = optimize_sr(g, g.ids, memory_budget=50_000_000, hardware=hw, **SETUP)
    assert result.policies[2] is R and result.fits


def test_an_impossible_budget_is_reported_not_hidden():
    g = chain([1.0, 1.0, 1.0], act=1_000_000, param=10_000_000)
    result = optimize_sr(g, g.ids, memory_budget=1_000_000, **SETUP)  # parameters alone exceed it
    assert not result.fits
    assert result.memory_bytes > 1_000_000
    with pytest.raises(ValueError, match="non-negative"):
        optimize_sr(g, g.ids, memory_budget=-1, **SETUP)
    with pytest.raises(ValueError, match="contiguous"):
        optimize_sr(g, [g.ids[0], g.ids[2]], **SETUP)
    with pytest.raises(ValueError, match=r"no layer\(s\) \[5\]"):
        optimize_sr(g, [g.ids[0], 5], **SETUP)


@settings(max_examples=120, deadline=None)
@given(dags(min_nodes=1, max_nodes=12), st.floats(0.0, 1.0), st.sampled_from(["gpipe", "1f1b", "pipedream"]),
       st.floats(1e8, 1e11))
def test_optimize_sr_fits_and_is_locally_optimal(graph, fraction, schedule, copy_bw):
    hw = Hardware(copy_bytes_per_s=copy_bw)
    setup = dict(stage=1, num_stages=4, schedule=schedule, micro_batches=6)
    ids = graph.ids
    keep_all = stage_memory(graph, ids, {}, hardware=hw, **setup)
    frugal = {n.id: min((S, R), key=lambda p: stage_memory(graph, [*ids], {n.id: p}, hardware=hw, **setup))
              for n in graph.nodes}
    least = stage_memory(graph, ids, frugal, hardware=hw, **setup)
    budget = least + fraction * (keep_all - least)
    result = optimize_sr(graph, ids, memory_budget=budget, hardware=hw, **setup)
    assert result.fits, "every layer on its most frugal policy fits, so optimize_sr must find a fit"
    memory = stage_memory(graph, ids, result.policies, hardware=hw, **setup)
    time = stage_time(graph, ids, result.policies, hw)
    assert memory <= budget * (1 + 1e-9)
    assert result.memory_bytes == pytest.approx(memory)
    assert result.stage_time_s == pytest.approx(time)
    for lid in ids:
        for other in (D, S, R):
            if other is result.policies[lid]:
                continue
            changed = {**result.policies, lid: other}
            if stage_memory(graph, ids, changed, hardware=hw, **setup) <= budget:
                assert stage_time(graph, ids, changed, hw) >= time * (1 - 1e-9), (lid, other)


@settings(max_examples=40, deadline=None)
@given(dags(min_nodes=2, max_nodes=8))
def test_a_budget_below_the_most_frugal_policies_does_not_fit(graph):
    ids = graph.ids
    setup = dict(stage=0, num_stages=2, schedule="gpipe", micro_batches=4)
    frugal = {n.id: min((D, S, R), key=lambda p: stage_memory(graph, ids, {n.id: p}, **setup))
              for n in graph.nodes}
    least = stage_memory(graph, ids, frugal, **setup)
    assume(least > 1)
    assert not optimize_sr(graph, ids, memory_budget=least * 0.999, **setup).fits
