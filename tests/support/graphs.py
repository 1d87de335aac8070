"""Small graphs and hypothesis strategies shared by the planner tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np
from hypothesis import strategies as st

from vpipe.graph import LayerGraph, LayerNode


def chain(costs_ms: Sequence[float], *, act: int = 1_000_000, param: int = 4_000_000, edge: int = 500_000,
          ids: Sequence[int] | None = None, name: str = "chain") -> LayerGraph:
    """A chain whose layer i costs ``costs_ms[i]`` (a third forward, two thirds backward)."""
    n = len(costs_ms)
    ids = list(ids) if ids is not None else [1000 + 7 * i for i in range(n)]  # not 0..n-1 on purpose
    nodes = [LayerNode(ids[i], f"l{i}", c / 3e3, 2 * c / 3e3, act, param, i) for i, c in enumerate(costs_ms)]
    edges = [(ids[i], ids[i + 1], edge) for i in range(n - 1)]
    return LayerGraph(name, nodes, edges)


@st.composite
def dags(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 9, chain_only: bool = False) -> LayerGraph:
    """Random DAGs in execution order: a backbone (mostly) plus random forward skip edges,
    random costs, activation, input and parameter sizes, ids that are not 0..n-1."""
    n = draw(st.integers(min_nodes, max_nodes))
    ids = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    times = st.floats(0.0, 5.0, allow_nan=False)
    nodes = [
        LayerNode(ids[i], f"n{i}", draw(times) * 1e-3, draw(times) * 1e-3, draw(st.integers(0, 50_000_000)),
                  draw(st.integers(0, 20_000_000)), i)
        for i in range(n)
    ]
    edges: dict[tuple[int, int], int] = {}
    for i in range(n - 1):
        if chain_only or draw(st.booleans()) or draw(st.booleans()):
            edges[(ids[i], ids[i + 1])] = draw(st.integers(0, 40_000_000))
    if not chain_only and n > 2:
        for _ in range(draw(st.integers(0, n))):
            a, b = sorted(draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True)))
            edges[(ids[a], ids[b])] = draw(st.integers(0, 40_000_000))
    return LayerGraph("random", nodes, [(s, d, b) for (s, d), b in edges.items()])


def all_cuts(n: int, p: int) -> Iterator[tuple[int, ...]]:
    """Every way to cut ``n`` positions into ``p`` non-empty contiguous stages."""
    return itertools.combinations(range(1, n), p - 1)


def boundary_bytes_by_definition(graph: LayerGraph) -> np.ndarray:
    """Bytes crossing each boundary straight from the definition: for every source before the
    boundary, the largest of its edges to a consumer at or after it."""
    pos = {node.id: i for i, node in enumerate(graph.nodes)}
    n = len(graph.nodes)
    out = np.zeros(n + 1)
    for c in range(1, n):
        largest: dict[int, int] = {}
        for s, d, b in graph.edges:
            if pos[s] < c <= pos[d]:
                largest[s] = max(largest.get(s, 0), b)
        out[c] = sum(largest.values())
    return out
