"""A chain of layers measured one at a time: :func:`from_layers` and :func:`profile_layers`.

Each layer runs forward and backward on what the layer before it returned, in this
process, so the costs are this machine's; the bytes autograd saves are counted with a pack
hook (:func:`vpipe.tensor_manager.accounting.count_saved_bytes`, the tensor manager's own
count), and the bytes a layer hands to the next one become the chain's edge.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vpipe.graph import LayerGraph, LayerNode
from vpipe.tensor_manager.accounting import count_saved_bytes, tensor_bytes

__all__ = ["LayerProfile", "from_layers", "profile_layers", "param_bytes"]


@dataclass(frozen=True)
class LayerProfile:
    """One layer's costs for one micro-batch: seconds, saved, parameter and output bytes."""

    fwd_s: float
    bwd_s: float
    act_bytes: int
    param_bytes: int
    out_bytes: int


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def from_layers(
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
    return LayerGraph(name=name, nodes=nodes, edges=edges)


def profile_layers(
    layers: Sequence[nn.Module],
    example_input: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    repeats: int = 3,
) -> list[LayerProfile]:
    """Time each layer's forward and backward in turn, count the bytes it saves."""
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
