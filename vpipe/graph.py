"""LayerGraph: the placement units of a model, their costs, and the data flowing between them.

The planner only ever sees this graph. A node is a unit that can be placed on a stage (a
layer of an ``nn.Sequential``, an operator of an fx trace, a block of a model); ``order`` is
its position in the execution order, which every edge must respect (a pipeline stage is a
contiguous range of it). Costs are per micro-batch: ``fwd_s``/``bwd_s`` in seconds,
``act_bytes`` the bytes autograd saves for the backward, ``param_bytes`` the parameters' bytes.

This module is the data model and its JSON (``docs/graph-format.md``), and it never imports
torch: ``vpipe plan GRAPH.json`` and the planner daemon read graphs without it. Graphs are
measured from modules by :mod:`vpipe.profiling`. Everything that enters from outside (JSON,
builders' results) is validated here, and any problem is reported as a ``ValueError`` that
names the node, edge or key at fault.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe.files import read_regular, write_output
from vpipe.sizes import MAX_BYTES

__all__ = ["LayerNode", "LayerGraph", "Roofline", "Unit", "ModelGraph", "load_graph"]


@dataclass(frozen=True)
class Roofline:
    """A deterministic cost estimate for fx nodes: time = max(FLOPs / peak, bytes moved / bandwidth).

    Measured times on a shared CPU are noisy and model-sized graphs are too big to run for
    real, so graphs built for planning and benchmarks can be traced on the meta device and
    costed from their shapes instead; the same graph then gives the same costs every time.
    """

    flops_per_s: float = 100e12
    bytes_per_s: float = 1.5e12

    def __post_init__(self) -> None:
        for what, value in (("flops_per_s", self.flops_per_s), ("bytes_per_s", self.bytes_per_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"roofline {what} must be a positive finite number, got {value}")

    def seconds(self, flops: int, moved_bytes: int) -> float:
        return max(flops / self.flops_per_s, moved_bytes / self.bytes_per_s)


@dataclass(frozen=True)
class LayerNode:
    """One placement unit. Times are seconds per micro-batch, sizes bytes."""

    id: int
    name: str
    fwd_s: float
    bwd_s: float
    act_bytes: int
    param_bytes: int
    order: int

    @property
    def cost_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass
class LayerGraph:
    """A DAG of placement units. Construct directly, through :meth:`from_dict`, or with the builders
    of :mod:`vpipe.profiling` (``from_layers``, ``from_fx``, ``profile_model``)."""

    name: str
    nodes: list[LayerNode]
    edges: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _validate(self)
        self.nodes.sort(key=lambda n: n.order)
        self._index = {n.id: i for i, n in enumerate(self.nodes)}

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self.nodes)

    def has(self, node_id: int) -> bool:
        """Whether the graph has a node ``node_id``."""
        return node_id in self._index

    def node(self, node_id: int) -> LayerNode:
        try:
            return self.nodes[self._index[node_id]]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no node {node_id}") from None

    def position(self, node_id: int) -> int:
        """Index of the node in execution order (0 .. len-1)."""
        return self._index[node_id]

    @property
    def ids(self) -> list[int]:
        """Node ids in execution order."""
        return [n.id for n in self.nodes]

    def successors(self) -> dict[int, list[tuple[int, int]]]:
        out: dict[int, list[tuple[int, int]]] = {n.id: [] for n in self.nodes}
        for s, d, b in self.edges:
            out[s].append((d, b))
        return out

    def total_cost_s(self) -> float:
        return sum(n.cost_s for n in self.nodes)

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nodes": [
                {
                    "id": n.id,
                    "name": n.name,
                    "fwd_ms": n.fwd_s * 1e3,
                    "bwd_ms": n.bwd_s * 1e3,
                    "act_bytes": n.act_bytes,
                    "param_bytes": n.param_bytes,
                    "order": n.order,
                }
                for n in self.nodes
            ],
            "edges": [[s, d, b] for s, d, b in self.edges],
        }

    @classmethod
    def from_dict(cls, data: Any) -> LayerGraph:
        """Build from the JSON schema of ``docs/graph-format.md``; extra keys are ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"graph must be a JSON object, got {type(data).__name__}")
        for key in ("nodes", "edges"):
            if key not in data:
                raise ValueError(f"graph is missing the key {key!r}")
        name = data.get("name", "graph")
        if not isinstance(name, str):
            raise ValueError(f"graph 'name' must be a string, got {type(name).__name__}")
        if not isinstance(data["nodes"], list):
            raise ValueError("graph 'nodes' must be a list")
        if not isinstance(data["edges"], list):
            raise ValueError("graph 'edges' must be a list")
        nodes = [_node_from_dict(i, raw) for i, raw in enumerate(data["nodes"])]
        edges = [_edge_from_list(i, raw) for i, raw in enumerate(data["edges"])]
        return cls(name=name, nodes=nodes, edges=edges)

    def save(self, path: str | Path, what: str = "graph file") -> None:
        """The graph's JSON as the whole of ``path``, never written through a link another user planted
        (one line naming it, :func:`vpipe.files.write_output`)."""
        write_output(path, json.dumps(self.to_dict(), indent=1).encode(), what)

    @classmethod
    def load(cls, path: str | Path) -> LayerGraph:
        text = _read_graph_text(path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"graph file {str(path)!r} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(
                f"graph file {str(path)!r} nests its JSON too deeply to be a layer graph"
            ) from None
        return cls.from_dict(data)


# --------------------------------------------------------------------- a model's graph
@dataclass(frozen=True)
class Unit:
    """A placement unit of a model: a block of a container of repeated blocks, or another module."""

    name: str  # the module's qualified name in the model
    container: str | None = None  # the block container's path for a block, None for any other module
    # measured from the model (None when read from a graph file): its class name, its trainable parameters
    kind: str | None = None
    params: int | None = None


@dataclass
class ModelGraph:
    """A model's layer graph (node ``i`` is ``units[i]``) and where it was measured."""

    graph: LayerGraph
    units: list[Unit]
    containers: list[str]
    device: str
    source: str = ""
    unused: list[str] = field(default_factory=list)  # modules the forward never called: not placed

    def to_dict(self) -> dict[str, Any]:
        """The graph's JSON (``docs/graph-format.md``), annotated with where it came from."""
        out = self.graph.to_dict()
        out["model"] = {"source": self.source, "device": self.device, "containers": self.containers,
                        "blocks": {u.name: u.container for u in self.units if u.container is not None},
                        "unused": self.unused}
        return out

    def save(self, path: str | Path, what: str = "graph file") -> None:
        """:meth:`to_dict` as the whole of ``path``, as :meth:`LayerGraph.save` writes."""
        write_output(path, json.dumps(self.to_dict(), indent=1).encode(), what)

    @classmethod
    def from_annotation(cls, graph: LayerGraph, raw: Any) -> ModelGraph:
        """Rebuild from a saved graph's ``"model"`` annotation (what :meth:`to_dict` writes)."""
        if not isinstance(raw, dict):
            raise ValueError("graph 'model' annotation must be an object")
        containers, blocks = raw.get("containers", []), raw.get("blocks", {})
        if not (isinstance(containers, list) and all(isinstance(c, str) for c in containers)):
            raise ValueError("graph 'model' annotation: 'containers' must be a list of module paths")
        if not (isinstance(blocks, dict) and all(isinstance(v, str) and v in containers
                                                 for v in blocks.values())):
            raise ValueError(
                "graph 'model' annotation: 'blocks' must map module names to one of 'containers'"
            )
        texts = {key: raw.get(key, "") for key in ("source", "device")}
        unused = raw.get("unused", [])
        if not all(isinstance(v, str) for v in texts.values()) or not (
                isinstance(unused, list) and all(isinstance(u, str) for u in unused)):
            raise ValueError("graph 'model' annotation: 'source' and 'device' must be strings, "
                             "'unused' a list of them")
        units = [Unit(node.name, blocks.get(node.name)) for node in graph.nodes]
        return cls(graph, units, containers, texts["device"], texts["source"], unused)


MAX_GRAPH_BYTES = 256 << 20  # a graph of a million layers is a few hundred MB; a bigger file is not a graph


def _read_graph_text(path: str | Path) -> str:
    return read_regular(path, MAX_GRAPH_BYTES, "graph file").decode("utf-8", errors="replace")


def load_graph(path: str | Path) -> tuple[LayerGraph, ModelGraph | None]:
    """A graph file, and its model annotation when ``vpipe plan --model --save-graph`` wrote one."""
    graph = LayerGraph.load(path)  # reads, validates, and names what is wrong
    data = json.loads(_read_graph_text(path))
    return graph, (ModelGraph.from_annotation(graph, data["model"]) if "model" in data else None)


# --------------------------------------------------------------------- validation
_NODE_KEYS: dict[str, Callable[[Any], bool]] = {
    "id": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "fwd_ms": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bwd_ms": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "act_bytes": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "param_bytes": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "order": lambda v: isinstance(v, int) and not isinstance(v, bool),
}


def _node_from_dict(i: int, raw: Any) -> LayerNode:
    if not isinstance(raw, dict):
        raise ValueError(f"node #{i} must be an object, got {type(raw).__name__}")
    for key, ok in _NODE_KEYS.items():
        if key not in raw:
            raise ValueError(f"node #{i} is missing the key {key!r}")
        if not ok(raw[key]):
            raise ValueError(f"node #{i}: {key!r} has the wrong type ({type(raw[key]).__name__})")
    name = raw.get("name", str(raw["id"]))
    if not isinstance(name, str):
        raise ValueError(f"node #{i}: 'name' must be a string")
    return LayerNode(
        id=raw["id"],
        name=name,
        fwd_s=float(raw["fwd_ms"]) / 1e3,
        bwd_s=float(raw["bwd_ms"]) / 1e3,
        act_bytes=raw["act_bytes"],
        param_bytes=raw["param_bytes"],
        order=raw["order"],
    )


def _edge_from_list(i: int, raw: Any) -> tuple[int, int, int]:
    if not isinstance(raw, (list, tuple)) or len(raw) != 3:
        raise ValueError(f"edge #{i} must be [src, dst, bytes], got {raw!r}")
    for v in raw:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"edge #{i} must hold three integers, got {raw!r}")
    return (raw[0], raw[1], raw[2])


MAX_SECONDS = 1e6  # per micro-batch: 11 days; sums of such values stay finite however many layers there are

def _validate(graph: LayerGraph) -> None:
    if not graph.nodes:
        raise ValueError(f"graph {graph.name!r} has no nodes")
    seen_ids: set[int] = set()
    seen_orders: dict[int, int] = {}
    for n in graph.nodes:
        if n.id in seen_ids:
            raise ValueError(f"duplicate node id {n.id}")
        seen_ids.add(n.id)
        if n.order in seen_orders:
            raise ValueError(f"nodes {seen_orders[n.order]} and {n.id} have the same order {n.order}")
        seen_orders[n.order] = n.id
        for what, value in (("fwd time", n.fwd_s), ("bwd time", n.bwd_s)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"node {n.id} ({n.name}) has a negative or non-finite {what}: {value}")
            if value > MAX_SECONDS:
                raise ValueError(f"node {n.id} ({n.name}) has a {what} of {value:.3g} s, "
                                 f"beyond any real layer (at most {MAX_SECONDS:.0e} s per micro-batch)")
        for what, value in (("act_bytes", n.act_bytes), ("param_bytes", n.param_bytes)):
            if value < 0:
                raise ValueError(f"node {n.id} ({n.name}) has negative {what}: {value}")
            if value > MAX_BYTES:
                raise ValueError(f"node {n.id} ({n.name}) has {what} of {len(str(value))} "
                                 f"digits, larger than any machine (at most {MAX_BYTES} bytes)")
    for s, d, b in graph.edges:
        for end in (s, d):
            if end not in seen_ids:
                raise ValueError(f"edge ({s}, {d}) names an unknown node id {end}")
        if b < 0:
            raise ValueError(f"edge ({s}, {d}) has negative bytes: {b}")
        if b > MAX_BYTES:
            raise ValueError(f"edge ({s}, {d}) has bytes of {len(str(b))} digits, larger than "
                             f"any machine (at most {MAX_BYTES})")
        if s == d:
            raise ValueError(f"edge ({s}, {d}) is a self-loop: the graph has a cycle")
    _check_acyclic(graph)
    order = {n.id: n.order for n in graph.nodes}
    for s, d, _ in graph.edges:
        if order[s] >= order[d]:
            raise ValueError(
                f"edge ({s}, {d}) goes against the execution order "
                f"(order {order[s]} -> {order[d]}); 'order' must be a topological order"
            )


def _check_acyclic(graph: LayerGraph) -> None:
    """Kahn's algorithm; on failure name one node on a cycle."""
    indeg = {n.id: 0 for n in graph.nodes}
    succ: dict[int, list[int]] = {n.id: [] for n in graph.nodes}
    for s, d, _ in graph.edges:
        succ[s].append(d)
        indeg[d] += 1
    ready = [i for i, k in indeg.items() if k == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    if done != len(graph.nodes):
        stuck = sorted(i for i, k in indeg.items() if k > 0)
        raise ValueError(f"graph has a cycle through node(s) {stuck[:5]}")
