"""One graph node per node of a ``torch.fx`` trace: :func:`from_fx`.

The finest placement a model allows (every operator a unit), used for the paper-sized
graphs the planner is tested and benchmarked on (:mod:`vpipe_lab.runtime.zoo`). The trace runs
once; its nodes are measured, estimated from their output sizes, or costed by a
:class:`~vpipe.graph.Roofline` from their FLOPs and bytes, which also works on the meta
device (model-sized graphs in seconds, the same costs on every run).
"""

from __future__ import annotations

import operator
import time
from typing import Any

import torch
from torch import fx, nn
from torch.fx import Interpreter
from torch.utils.flop_counter import FlopCounterMode

from vpipe.graph import LayerGraph, LayerNode, Roofline
from vpipe.profiling.layers import param_bytes
from vpipe.tensor_manager.accounting import tensor_bytes

__all__ = ["from_fx"]


def from_fx(
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
                fwd = roofline.seconds(recorder.flops.get(node.name, 0),
                                       moved) if node.op.startswith("call") else 0.0
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
    return LayerGraph(name=name or type(module).__name__, nodes=nodes, edges=edges)


class _FxRecorder:
    """Runs an fx GraphModule node by node, recording output bytes and (optionally) time or FLOPs."""

    def __init__(self, gm: fx.GraphModule, measure: bool, count_flops: bool = False) -> None:
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


def _is_view_like(node: fx.Node) -> bool:
    """True for fx nodes that return a view or metadata (no new storage, no arithmetic)."""
    if node.op == "call_method":
        return node.target in _VIEW_TARGETS
    if node.op == "call_function":
        if node.target is operator.getitem or node.target is getattr:
            return True
        return getattr(node.target, "__name__", "") in _VIEW_TARGETS
    return False


def _fx_param_bytes(gm: fx.GraphModule, node: fx.Node) -> int:
    if node.op == "call_module":
        assert isinstance(node.target, str)  # a call_module node's target is the submodule's qualified name
        return param_bytes(gm.get_submodule(node.target))
    if node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return tensor_bytes(obj) if isinstance(obj, nn.Parameter) else 0
    return 0
