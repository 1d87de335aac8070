"""Measure a model at the granularity a pipeline splits it: its repeated blocks and other modules.

The units are those :func:`vpipe.profiling.units.find_units` finds.

Measuring, with the user's forward intact. The model's own forward runs once on the example
micro-batch with forward pre/post hooks on the units, which record each unit's actual
positional and keyword arguments (so blocks called as ``layer(h, memory)`` or with an
attention mask work) and its outputs, and give the execution order. Then each unit runs
alone on its recorded inputs, forward under a pack hook (the activation bytes autograd
saves) and backward from its outputs, timed (median of ``repeats``, after a warm-up; with a
device sync on CUDA). Inputs that required grad in the real run require it in the replay
(as non-leaf tensors, so in-place operations on them work as they did); other arguments
are deep-copied for every replay, so a stateful one (a key/value cache) is the same each time.

The graph. Node ``i`` is the ``i``-th unit to run. A tensor a unit receives is charged to
the boundary before it (an edge from the unit before), unless it is the very tensor an
earlier, non-adjacent unit returned: then it is a skip edge from that unit, crossing every
boundary between. Work the forward does outside every unit (adding position embeddings,
building masks) is not measured, and a tensor it makes counts only at the unit that takes it.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vpipe.graph import LayerGraph, LayerNode, ModelGraph, Unit
from vpipe.profiling.factory import one_line
from vpipe.profiling.units import find_units
from vpipe.tensor_manager.accounting import count_saved_bytes, tensor_bytes

__all__ = ["profile_model"]


# --------------------------------------------------------------------- the recording run
@dataclass
class _Call:
    """One call of a unit during the real forward."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    needs_grad: list[bool]  # per tensor input, in flattening order
    input_ids: list[int] = field(default_factory=list)  # id() of each tensor input
    outputs: list[torch.Tensor] = field(default_factory=list)


def _flatten(value: Any, out: list[torch.Tensor], *, plain: bool = False) -> list[torch.Tensor]:
    """Tensors in a nested value: tuples, lists and dicts (a Hugging Face ModelOutput is one).

    With ``plain`` only built-in dicts are opened: the arguments' traversal, which must match
    :func:`_snapshot`'s (other objects are copied whole, and their tensors are not inputs)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, tuple | list):
        for v in value:
            _flatten(v, out, plain=plain)
    elif isinstance(value, dict) and (not plain or type(value) is dict):
        for v in value.values():
            _flatten(v, out, plain=plain)
    return out


def _copy_tree(value: Any, copy_tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of call arguments: tensors through ``copy_tensor`` (in the order they appear), tuples, lists
    and plain dicts rebuilt, the rest deep-copied (a cache the forward mutates later is kept as it was)."""
    if isinstance(value, torch.Tensor):
        return copy_tensor(value)
    if isinstance(value, tuple | list):
        copied = [_copy_tree(v, copy_tensor) for v in value]
        return tuple(copied) if isinstance(value, tuple) else copied
    if isinstance(value, dict) and type(value) is dict:
        return {k: _copy_tree(v, copy_tensor) for k, v in value.items()}
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - not copyable: replay with the object itself
        return value


def _snapshot(value: Any) -> Any:
    """A unit's arguments as they were at the call: tensors cloned."""
    return _copy_tree(value, lambda t: t.detach().clone())


class _Recorder:
    """Forward hooks on the units: their calls' inputs and outputs, in execution order.

    With ``snapshots`` off it records only which tensor inputs require grad (a run with
    autograd on); with them on (a run under ``no_grad``, so that a cache of activations can
    be deep-copied) it copies the arguments, takes the grad flags from ``needs_grad``
    (the first run's, by unit and call) and keeps the outputs."""

    def __init__(self, model: nn.Module, units: list[Unit], snapshots: bool,
                 needs_grad: dict[tuple[int, int], list[bool]] | None = None) -> None:
        self.units, self.snapshots = units, snapshots
        self.needs_grad: dict[tuple[int, int], list[bool]] = needs_grad if needs_grad is not None else {}
        self.calls: dict[int, list[_Call]] = {}
        self.order: list[int] = []  # unit indices by first call
        self._count: dict[int, int] = {}
        self._active: list[int] = []
        self._handles = []
        for i, unit in enumerate(units):
            module = model.get_submodule(unit.name)
            self._handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(i), with_kwargs=True))

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._active.append(i)
            if len(self._active) > 1:  # called from inside another unit: part of that one
                return
            tensors = _flatten((args, kwargs), [], plain=True)
            n = self._count.get(i, 0)
            self._count[i] = n + 1
            if not self.snapshots:
                self.needs_grad[(i, n)] = [t.requires_grad for t in tensors]
                return
            flags = self.needs_grad.get((i, n))
            if flags is None or len(flags) != len(tensors):  # the two runs differ: guess from the dtype
                flags = [t.is_floating_point() for t in tensors]
            call = _Call(_snapshot(args), _snapshot(kwargs), flags, [id(t) for t in tensors])
            if i not in self.calls:
                self.calls[i] = []
                self.order.append(i)
            self.calls[i].append(call)
        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self._active.pop()
            if not self._active and self.snapshots:
                self.calls[i][-1].outputs = _flatten(output, [])  # kept alive: their id()s stay unique
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _record(model: nn.Module, units: list[Unit], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Recorder:
    """Two runs of the user's forward: with autograd (which inputs require grad), then under
    ``no_grad`` (copies of every unit's arguments: tensors that are part of an autograd
    graph, such as a key/value cache, cannot be deep-copied)."""
    needs_grad: dict[tuple[int, int], list[bool]] = {}
    for snapshots in (False, True):
        recorder = _Recorder(model, units, snapshots, needs_grad)
        try:
            with torch.set_grad_enabled(not snapshots):
                model(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the user's forward on the user's input
            raise ValueError(f"running the model on the example input failed: {one_line(e)}") from None
        finally:
            recorder.remove()
    return recorder


# --------------------------------------------------------------------- measuring one unit
@dataclass(frozen=True)
class _Measured:
    fwd_s: float
    bwd_s: float
    act_bytes: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _replay_inputs(call: _Call) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh inputs for one replay: tensors that required grad become non-leaf tensors that do."""
    flags = iter(call.needs_grad)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if next(flags, False) and (t.is_floating_point() or t.is_complex()):
            return t.detach().requires_grad_(True).clone()
        return t.clone()

    return _copy_tree(call.args, fresh), _copy_tree(call.kwargs, fresh)


def _measure(module: nn.Module, calls: list[_Call], repeats: int, device: torch.device) -> _Measured:
    fwd, bwd, saved = 0.0, 0.0, 0
    for call in calls:
        fwd_times, bwd_times = [], []
        for run in range(repeats + 1):  # the first is a warm-up
            args, kwargs = _replay_inputs(call)
            _sync(device)
            t0 = time.perf_counter()
            with count_saved_bytes(module) as counter:
                out = module(*args, **kwargs)
            _sync(device)
            t1 = time.perf_counter()
            outs = [o for o in _flatten(out, []) if o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            _sync(device)
            t2 = time.perf_counter()
            del out, outs
            if run:
                fwd_times.append(t1 - t0)
                bwd_times.append(t2 - t1)
        fwd += statistics.median(fwd_times)
        bwd += statistics.median(bwd_times)
        saved += counter.bytes
    module.zero_grad(set_to_none=True)
    return _Measured(fwd, bwd, saved)


# --------------------------------------------------------------------- the graph
def profile_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
                  device: str | torch.device = "cpu", repeats: int = 3,
                  containers: Sequence[str] | None = None,
                  source: str = "", name: str | None = None) -> ModelGraph:
    """Find ``model``'s units, run its forward once on ``args``/``kwargs`` (one micro-batch)
    recording each unit's calls, measure every unit alone, and return the layer graph.

    Raises ``ValueError`` (one line) when the forward or a unit's replay fails."""
    device = torch.device(device)
    kwargs = kwargs or {}
    units, chosen = find_units(model, containers)
    try:
        model.to(device)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot move the model to {device}: {one_line(e)}") from None
    args, kwargs = _to(args, device), _to(kwargs, device)
    recorder = _record(model, units, args, kwargs)
    order = recorder.order
    if not order:
        raise ValueError("the model's forward called none of its modules: nothing to place on stages")
    position = {unit: k for k, unit in enumerate(order)}
    producer: dict[int, tuple[int, int]] = {}  # id(output tensor) -> (position, bytes)
    nodes: list[LayerNode] = []
    edges: list[tuple[int, int, int]] = []
    for k, i in enumerate(order):
        unit, calls = units[i], recorder.calls[i]
        module = model.get_submodule(unit.name)
        try:
            measured = _measure(module, calls, max(1, repeats), device)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"replaying {unit.name or 'the model'} on its recorded inputs failed: "
                             f"{one_line(e)}") from None
        first = calls[0]
        chain = 0
        skips: dict[int, int] = {}  # source position -> bytes it hands past its successor
        seen: set[int] = set()
        for tensor_id, t in zip(first.input_ids, _flatten((first.args, first.kwargs), [], plain=True)):
            if tensor_id in seen:
                continue
            seen.add(tensor_id)
            source_pos, nbytes = producer.get(tensor_id, (None, tensor_bytes(t)))
            if source_pos is not None and source_pos < k - 1:
                skips[source_pos] = skips.get(source_pos, 0) + nbytes
            else:
                chain += nbytes
        if k > 0:
            edges.append((k - 1, k, chain))
        edges.extend((src, k, nbytes) for src, nbytes in sorted(skips.items()))
        for call in calls:
            for t in call.outputs:
                producer.setdefault(id(t), (k, tensor_bytes(t)))
        params = {id(p): p for p in module.parameters()}
        nodes.append(LayerNode(id=k, name=unit.name or type(model).__name__, fwd_s=measured.fwd_s,
                               bwd_s=measured.bwd_s, act_bytes=measured.act_bytes,
                               param_bytes=sum(tensor_bytes(p) for p in params.values()), order=k))
    graph = LayerGraph(name or type(model).__name__, nodes, edges)
    unused = [units[i].name for i in range(len(units)) if i not in position]
    placed = [units[i] for i in order]
    ran = [u.container for u in placed]
    containers = sorted((c for c in chosen if c in ran), key=ran.index)  # in execution order
    return ModelGraph(graph, placed, containers, str(device), source, unused)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        moved = [_to(v, device) for v in value]
        return tuple(moved) if isinstance(value, tuple) else moved
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
