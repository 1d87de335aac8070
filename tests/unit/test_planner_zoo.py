"""Acceptance on the paper's model sizes: valid pipelines, within 2 % of the optimal slowest
stage and 10 % of the fewest boundary bytes, at 4 to 128 stages. (Planning time is a
benchmark, benchmarks/planner_bench.py, not a test.)"""

from __future__ import annotations

import networkx as nx
import pytest

from vpipe.graph import LayerGraph
from vpipe.planner.partition import is_valid_pipeline
from vpipe.planner.srp import plan_pipeline
from vpipe_lab.runtime import zoo

# (nodes, edges) the paper's Table 4 reports, and how close the zoo must come
PAPER_SIZES = {"bert-large": (976, 1262), "transformer": (662, 830), "amoebanet": (4380, 5080),
               "gnmt": (190, 228)}


@pytest.fixture(scope="module")
def graphs() -> dict[str, LayerGraph]:
    return {name: build() for name, build in zoo.ZOO.items()}


def test_zoo_graphs_have_the_papers_sizes_and_deterministic_costs(graphs):
    for name, graph in graphs.items():
        nodes, edges = PAPER_SIZES[name]
        assert 0.8 * nodes <= len(graph) <= 1.2 * nodes, name
        assert 0.8 * edges * len(graph) / nodes <= len(graph.edges) <= 1.3 * edges, name
        assert graph.total_cost_s() > 0 and all(n.fwd_s >= 0 for n in graph.nodes)
    again = zoo.transformer()
    assert again.nodes == graphs["transformer"].nodes and again.edges == graphs["transformer"].edges


@pytest.mark.parametrize("stages", [4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_kl_plan_is_valid_and_near_the_optimum(graphs, name, stages):
    graph = graphs[name]
    kl = plan_pipeline(graph, stages)
    exact = plan_pipeline(graph, stages, method="exact")
    for result in (kl, exact):
        assert len(result.stages) == stages
        assert is_valid_pipeline(graph.ids, graph.edges, result.stages)
    assert kl.bottleneck_s <= exact.bottleneck_s * 1.02
    assert kl.bottleneck_s >= exact.bottleneck_s * (1 - 1e-9)  # the oracle is never beaten
    assert kl.comm_bytes <= exact.comm_bytes * 1.10


def test_plain_kernighan_lin_does_not_give_a_pipeline(graphs):
    """Why Alg. 3 keeps stages contiguous: networkx's KL on the real graph cuts backwards."""
    graph = graphs["gnmt"]
    undirected = nx.Graph()
    undirected.add_nodes_from(graph.ids)
    undirected.add_weighted_edges_from(graph.edges)
    left, right = nx.algorithms.community.kernighan_lin_bisection(undirected, weight="weight", seed=0)
    order = {lid: i for i, lid in enumerate(graph.ids)}
    stages = [sorted(part, key=order.get) for part in (left, right)]
    stages.sort(key=lambda s: order[s[0]])
    assert not is_valid_pipeline(graph.ids, graph.edges, stages)
