"""LayerGraph: the builders of vpipe.profiling, JSON round trip, and
a clear error for every kind of bad input."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from vpipe.graph import LayerGraph, LayerNode, Roofline
from vpipe.profiling import from_fx, from_layers
from vpipe_lab.runtime.models import build_model, cnn, transformer_lm


def _chain(n: int = 4) -> dict:
    return {
        "name": "chain",
        "nodes": [{"id": i, "name": f"l{i}", "fwd_ms": 1.0 + i, "bwd_ms": 2.0, "act_bytes": 100 * i,
                   "param_bytes": 10, "order": i, "extra": "ignored"} for i in range(n)],
        "edges": [[i, i + 1, 64] for i in range(n - 1)],
        "comment": "extra keys are ignored",
    }


def test_json_round_trip(tmp_path):
    g = LayerGraph.from_dict(_chain())
    path = tmp_path / "g.json"
    g.save(path)
    again = LayerGraph.load(path)
    assert again.nodes == g.nodes
    assert again.edges == g.edges
    assert again.node(2).fwd_s == pytest.approx(3e-3)


def test_layers_builder_profiles_a_chain():
    spec = transformer_lm(n_blocks=2, d_model=32, n_heads=2, seq_len=16, dropout=0.0)
    model = build_model(spec)
    x, _ = spec.batch(0, 2, seed=0)
    g = from_layers(list(model), x, skip_edges=[(0, 3)], repeats=1)
    assert [n.id for n in g.nodes] == [0, 1, 2, 3]
    assert (0, 3, 2 * 16 * 32 * 4) in g.edges  # the skip carries the embedding's output bytes
    assert all(n.fwd_s > 0 and n.bwd_s > 0 for n in g.nodes)
    assert g.node(1).act_bytes > 0  # a block saves activations
    assert g.node(0).param_bytes == sum(p.numel() * 4 for p in model[0].parameters())


@pytest.mark.parametrize("spec", [transformer_lm(n_blocks=2, d_model=32, n_heads=2, seq_len=16), cnn()],
                         ids=["transformer", "cnn"])
def test_fx_graph_is_acyclic_with_one_node_per_fx_node(spec):
    model = build_model(spec)
    x, _ = spec.batch(0, 2, seed=0)
    traced = fx.symbolic_trace(model)
    g = from_fx(traced, (x,))
    assert len(g) == len(list(traced.graph.nodes))
    assert [n.name for n in g.nodes] == [n.name for n in traced.graph.nodes]
    order = {n.id: n.order for n in g.nodes}
    assert all(order[s] < order[d] for s, d, _ in g.edges)  # validated DAG in execution order
    assert sum(n.param_bytes for n in g.nodes) == sum(p.numel() * 4 for p in model.parameters())


def _error(data) -> str:
    with pytest.raises(ValueError) as info:
        LayerGraph.from_dict(data)
    return str(info.value)


def test_malformed_graphs_name_the_problem(tmp_path):
    bad_file = tmp_path / "bad.json"
    bad_file.write_text("{nodes: [")
    with pytest.raises(ValueError, match="not valid JSON"):
        LayerGraph.load(bad_file)
    with pytest.raises(ValueError, match="graph file .*missing.json does not exist"):
        LayerGraph.load(tmp_path / "missing.json")

    assert "must be a JSON object" in _error([1, 2])
    assert "missing the key 'nodes'" in _error({"edges": []})

    data = _chain()
    data["edges"].append([1, 99, 8])
    assert "unknown node id 99" in _error(data)

    data = _chain()
    data["edges"].append([3, 1, 8])
    assert "cycle" in _error(data)

    data = _chain()
    data["nodes"][2]["fwd_ms"] = -1.0
    assert "node 2 (l2) has a negative" in _error(data)

    data = _chain()
    data["nodes"][1]["act_bytes"] = -5
    assert "negative act_bytes" in _error(data)

    data = _chain()
    data["edges"][0][2] = -1
    assert "negative bytes" in _error(data)

    data = _chain()
    data["nodes"][0]["id"] = "zero"
    assert "'id' has the wrong type" in _error(data)

    data = _chain()
    data["nodes"][3]["id"] = 2
    assert "duplicate node id 2" in _error(data)

    data = _chain()
    data["nodes"][1]["order"], data["nodes"][2]["order"] = 2, 1
    assert "goes against the execution order" in _error(data)

    data = _chain()
    del data["nodes"][0]["bwd_ms"]
    assert "node #0 is missing the key 'bwd_ms'" in _error(data)

    assert "edge #0 must be [src, dst, bytes]" in _error({"nodes": _chain()["nodes"], "edges": [[0, 1]]})


def test_cycle_without_order_violation_is_reported_as_cycle():
    nodes = [LayerNode(i, f"n{i}", 0.0, 0.0, 0, 0, i) for i in range(3)]
    with pytest.raises(ValueError, match="cycle"):
        LayerGraph("g", nodes, [(0, 1, 1), (1, 2, 1), (2, 0, 1)])


def test_fx_roofline_costs_are_deterministic_and_views_are_free():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 32)

        def forward(self, x):
            return torch.relu(self.fc(x).view(8, 4, 32))

    with torch.device("meta"):
        model, x = Tiny(), torch.zeros(32, 64)
    roof = Roofline(flops_per_s=1e9, bytes_per_s=1e12)
    g = from_fx(model, (x,), roofline=roof)
    by_name = {n.name: n for n in g.nodes}
    assert by_name["fc"].fwd_s == pytest.approx(2 * 32 * 64 * 32 / 1e9)  # matmul FLOPs / peak
    assert by_name["fc"].bwd_s == pytest.approx(2 * by_name["fc"].fwd_s)
    assert by_name["view"].fwd_s == 0 and by_name["view"].act_bytes == 0  # a view allocates nothing
    assert by_name["relu"].fwd_s == pytest.approx(2 * 32 * 32 * 4 / 1e12)  # memory-bound: read + write
    assert from_fx(model, (x,), roofline=roof).nodes == g.nodes
    with pytest.raises(ValueError, match="flops_per_s must be a positive finite number"):
        Roofline(flops_per_s=0)
