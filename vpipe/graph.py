"""LayerGraph: the placement units of a model, their costs, and the data flowing between them.

The planner only ever sees this graph. A node is a unit that can be placed on a stage (a
layer of an ``nn.Sequential`` or an operator of an fx trace); ``order`` is its position in
the execution order, which every edge must respect (a pipeline stage is a contiguous range
of it). Costs are per micro-batch: ``fwd_s``/``bwd_s`` in seconds, ``act_bytes`` the bytes
autograd saves for the backward, ``param_bytes`` the parameters' bytes.

Everything that enters from outside (JSON, builders' arguments) is validated here, and any
problem is reported as a ``ValueError`` that names the node, edge or key at fault.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vpipe.sizes import MAX_BYTES

if TYPE_CHECKING:  # torch loads only when a builder runs: `vpipe plan` and the planner daemon stay light
    import torch
    from torch import nn

__all__ = ["LayerNode", "LayerGraph", "Roofline"]


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
    """A DAG of placement units. Construct through the builders or :meth:`from_dict`."""

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

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> LayerGraph:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"cannot read graph file {str(path)!r}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"graph file {str(path)!r} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"graph file {str(path)!r} nests its JSON too deeply to be a layer graph") from None
        return cls.from_dict(data)

    # ----------------------------------------------------------------- builders
    @classmethod
    def from_layers(
        cls,
        layers: Sequence[nn.Module] | nn.Sequential,
        example_input: torch.Tensor | tuple[torch.Tensor, ...],
        *,
        skip_edges: Iterable[tuple[int, int]] = (),
        ids: Sequence[int] | None = None,
        name: str = "layers",
        repeats: int = 3,
    ) -> LayerGraph:
        """Profile a chain of layers on ``example_input`` (one micro-batch).

        Each layer is timed forward and backward one after another in this process (the
        median of ``repeats`` runs), its saved activations are counted with a pack hook and
        the bytes it hands to the next layer become the chain edge. ``skip_edges`` are extra
        ``(src_index, dst_index)`` data dependencies (e.g. a U-Net's long skips); they carry
        the source's output bytes.
        """
        layers = list(layers)
        if not layers:
            raise ValueError("from_layers needs at least one layer")
        ids = list(range(len(layers))) if ids is None else list(ids)
        if len(ids) != len(layers):
            raise ValueError(f"got {len(ids)} ids for {len(layers)} layers")
        profiles = profile_layers(layers, example_input, repeats=repeats)
        nodes = [
            LayerNode(
                id=ids[i],
                name=f"{i}:{type(layer).__name__}",
                fwd_s=p.fwd_s,
                bwd_s=p.bwd_s,
                act_bytes=p.act_bytes,
                param_bytes=p.param_bytes,
                order=i,
            )
            for i, (layer, p) in enumerate(zip(layers, profiles))
        ]
        edges = [(ids[i], ids[i + 1], profiles[i].out_bytes) for i in range(len(layers) - 1)]
        for src, dst in skip_edges:
            if not (0 <= src < len(layers) and 0 <= dst < len(layers)):
                raise ValueError(f"skip edge ({src}, {dst}) names a layer outside 0..{len(layers) - 1}")
            edges.append((ids[src], ids[dst], profiles[src].out_bytes))
        return cls(name=name, nodes=nodes, edges=edges)

    @classmethod
    def from_fx(
        cls,
        module: nn.Module,
        example_inputs: tuple[Any, ...],
        *,
        name: str | None = None,
        measure: bool = True,
        bwd_factor: float = 2.0,
        roofline: Roofline | None = None,
    ) -> LayerGraph:
        """One node per node of a ``torch.fx`` trace (placeholders and output included).

        The trace is run once on ``example_inputs``; every node's output bytes become the
        bytes of its outgoing edges and its ``act_bytes``; parameters are charged to the
        ``get_attr``/``call_module`` node that owns them. With ``measure`` each node's forward
        is timed, else its cost is estimated from its output size; the backward is
        ``bwd_factor`` times the forward (the usual 2x of a matmul-dominated model).

        With ``roofline`` (which overrides ``measure``) the forward is estimated from the
        node's FLOPs (``torch.utils.flop_counter``) and the bytes it reads and writes, so the
        module and inputs may live on the meta device: model-sized graphs trace in seconds
        and get the same costs on every run. View-like nodes (``view``, ``transpose``,
        ``getitem`` ...) allocate nothing, so in this mode they cost nothing and save nothing.
        """
        import torch
        from torch import fx

        gm = module if isinstance(module, fx.GraphModule) else fx.symbolic_trace(module)
        recorder = _FxRecorder(gm, measure=measure and roofline is None, count_flops=roofline is not None)
        with torch.no_grad():
            recorder.run(*example_inputs)
        index = {node.name: i for i, node in enumerate(gm.graph.nodes)}
        nodes: list[LayerNode] = []
        edges: list[tuple[int, int, int]] = []
        for i, node in enumerate(gm.graph.nodes):
            out_bytes = recorder.out_bytes.get(node.name, 0)
            act_bytes = out_bytes if node.op not in ("placeholder", "output") else 0
            if roofline is not None:
                if _is_view_like(node):
                    fwd, act_bytes = 0.0, 0
                else:
                    moved = out_bytes + sum(recorder.out_bytes.get(a.name, 0) for a in node.all_input_nodes)
                    fwd = roofline.seconds(recorder.flops.get(node.name, 0), moved) if node.op.startswith("call") else 0.0
            elif measure:
                fwd = recorder.seconds.get(node.name, 0.0)
            else:
                fwd = out_bytes * 1e-10
            nodes.append(
                LayerNode(
                    id=i,
                    name=node.name,
                    fwd_s=fwd,
                    bwd_s=fwd * bwd_factor,
                    act_bytes=act_bytes,
                    param_bytes=_fx_param_bytes(gm, node),
                    order=i,
                )
            )
            for user in node.users:
                edges.append((i, index[user.name], out_bytes))
        return cls(name=name or type(module).__name__, nodes=nodes, edges=edges)


# --------------------------------------------------------------------- profiling
@dataclass(frozen=True)
class LayerProfile:
    fwd_s: float
    bwd_s: float
    act_bytes: int
    param_bytes: int
    out_bytes: int


def tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in a (nested) value."""
    import torch
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def profile_layers(
    layers: Sequence[nn.Module],
    example_input: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    repeats: int = 3,
) -> list[LayerProfile]:
    """Time each layer's forward and backward in turn, count the bytes it saves."""
    import torch
    from vpipe.tensor_manager.accounting import count_saved_bytes

    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    profiles = []
    for layer in layers:
        leaf_inputs = tuple(_as_leaf(x) for x in inputs)
        fwd_times, bwd_times = [], []
        saved = 0
        out: Any = None
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            with count_saved_bytes(layer) as counter:
                out = layer(*leaf_inputs)
            t1 = time.perf_counter()
            saved = counter.bytes
            outs = [o for o in _flatten(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            t2 = time.perf_counter()
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1)
        layer.zero_grad(set_to_none=True)
        profiles.append(
            LayerProfile(
                fwd_s=_median(fwd_times),
                bwd_s=_median(bwd_times),
                act_bytes=saved,
                param_bytes=param_bytes(layer),
                out_bytes=tensor_bytes(out),
            )
        )
        inputs = tuple(o.detach() for o in _flatten(out) if isinstance(o, torch.Tensor))
    return profiles


def _as_leaf(x: Any) -> Any:
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point())
    return x


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _flatten(item)]
    return [value]


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2]


class _FxRecorder:
    """Runs an fx GraphModule node by node, recording output bytes and (optionally) time or FLOPs."""

    def __init__(self, gm: Any, measure: bool, count_flops: bool = False) -> None:
        from torch.fx import Interpreter
        from torch.utils.flop_counter import FlopCounterMode

        recorder = self
        self.out_bytes: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.flops: dict[str, int] = {}

        class _Interp(Interpreter):
            def run_node(self, n):  # noqa: ANN001, ANN202 - fx's signature
                if count_flops and n.op.startswith("call"):
                    with FlopCounterMode(display=False) as counter:
                        result = super().run_node(n)
                    recorder.flops[n.name] = counter.get_total_flops()
                else:
                    t0 = time.perf_counter()
                    result = super().run_node(n)
                    if measure:
                        recorder.seconds[n.name] = time.perf_counter() - t0
                recorder.out_bytes[n.name] = tensor_bytes(result)
                return result

        self._interp = _Interp(gm)

    def run(self, *args: Any) -> Any:
        return self._interp.run(*args)


_VIEW_TARGETS = frozenset({
    "view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "flatten",
    "size", "dim", "chunk", "split", "unbind", "narrow", "select", "t", "view_as", "expand_as",
})


def _is_view_like(node: Any) -> bool:
    """True for fx nodes that return a view or metadata (no new storage, no arithmetic)."""
    import operator

    if node.op == "call_method":
        return node.target in _VIEW_TARGETS
    if node.op == "call_function":
        if node.target is operator.getitem or node.target is getattr:
            return True
        return getattr(node.target, "__name__", "") in _VIEW_TARGETS
    return False


def _fx_param_bytes(gm: Any, node: Any) -> int:
    from torch import nn
    if node.op == "call_module":
        return param_bytes(gm.get_submodule(node.target))
    if node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return tensor_bytes(obj) if isinstance(obj, nn.Parameter) else 0
    return 0


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
                raise ValueError(f"node {n.id} ({n.name}) has a {what} of {value:.3g} s, beyond any real layer "
                                 f"(at most {MAX_SECONDS:.0e} s per micro-batch)")
        for what, value in (("act_bytes", n.act_bytes), ("param_bytes", n.param_bytes)):
            if value < 0:
                raise ValueError(f"node {n.id} ({n.name}) has negative {what}: {value}")
            if value > MAX_BYTES:
                raise ValueError(f"node {n.id} ({n.name}) has {what} of {len(str(value))} digits, larger than any "
                                 f"machine (at most {MAX_BYTES} bytes)")
    for s, d, b in graph.edges:
        for end in (s, d):
            if end not in seen_ids:
                raise ValueError(f"edge ({s}, {d}) names an unknown node id {end}")
        if b < 0:
            raise ValueError(f"edge ({s}, {d}) has negative bytes: {b}")
        if b > MAX_BYTES:
            raise ValueError(f"edge ({s}, {d}) has bytes of {len(str(b))} digits, larger than any machine (at most "
                             f"{MAX_BYTES})")
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
