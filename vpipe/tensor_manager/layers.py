"""The modules a tensor manager manages: their hooks, the recompute forward, one layer call.

A managed layer gets a forward pre-hook and an always-called forward hook (so an exception
in the forward still pops what the pre-hook pushed). While its policy is R it also carries
an instance attribute ``forward`` that routes the call to the manager; the attribute the
module had before (usually none) comes back when the policy changes or the layer is
detached. Nothing else of the module is touched, and its parent is never touched.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vpipe.compat.torch_internals import view_base
from vpipe.plan import Policy
from vpipe.tensor_manager.accounting import RecomputeCounter, local_of
from vpipe.tensor_manager.handles import StorageEntry
from vpipe.tensor_manager.replay import forget_weight_places

__all__ = ["ManagedLayer", "LayerCall", "KeptCall", "input_shapes", "claim_module", "release_module",
           "ROUTED_FORWARD", "is_routed_forward"]

# the ``forward`` instance attribute vpipe sets for recompute carries this attribute (a clone drops it)
ROUTED_FORWARD = "_vpipe_routed_forward"


def is_routed_forward(fn: object) -> bool:
    """Whether ``fn`` is the forward vpipe set on a recomputed layer (a clone must not copy it)."""
    return bool(getattr(fn, ROUTED_FORWARD, False))


_MISSING = object()
_owners: weakref.WeakKeyDictionary[nn.Module, object] = weakref.WeakKeyDictionary()


def check_sizes(*, budget_bytes: int | None, host_pool_bytes: int | None, min_swap_bytes: int) -> None:
    """A tensor manager's sizes, checked before it allocates anything."""
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise ValueError(f"budget_bytes must be a positive integer or None, got {budget_bytes!r}")
    if host_pool_bytes is not None and (not isinstance(host_pool_bytes, int) or host_pool_bytes <= 0):
        raise ValueError(f"host_pool_bytes must be a positive integer or None, got {host_pool_bytes!r}")
    if not isinstance(min_swap_bytes, int) or min_swap_bytes < 0:
        raise ValueError(f"min_swap_bytes must be a non-negative integer, got {min_swap_bytes!r}")


def claim_module(module: nn.Module, owner: object, layer_id: int, managed: Container[int]) -> None:
    """A module is managed by one manager at a time (two sets of hooks would fight), under a non-negative id
    that the manager does not use yet (``managed``: the ids it uses)."""
    if not isinstance(layer_id, int) or isinstance(layer_id, bool) or layer_id < 0:
        raise ValueError(f"layer id must be a non-negative integer, got {layer_id!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"layer {layer_id} must be an nn.Module, got {type(module).__name__}")
    if layer_id in managed:
        raise ValueError(f"layer {layer_id} is already managed by this tensor manager")
    current = _owners.get(module)
    if current is not None:
        where = "this" if current is owner else "another"
        raise ValueError(
            f"the module given for layer {layer_id} is already managed by {where} tensor manager"
        )
    _owners[module] = owner


def release_module(module: nn.Module) -> None:
    _owners.pop(module, None)


@dataclass(eq=False)
class ManagedLayer:
    layer_id: int
    module: nn.Module
    policy: Policy = Policy.KEEP
    hooks: list[RemovableHandle] = field(default_factory=list)
    has_buffers: bool = False
    wrapper: Any = None  # the forward instance attribute while the policy is R
    original_forward: Any = _MISSING  # module.__dict__["forward"] before the wrapper was set
    forward_s: float | None = None  # moving average of one managed forward
    recompute_s: float = 0.0
    recomputes: int = 0  # forwards run again in a backward
    recompute_calls: int = 0  # managed calls under R (each is recomputed once, whatever the schedule)
    # what its last metered call under D saved that no earlier layer of its micro-batch saved
    # (the output of the layer before it counts there, once)
    kept_bytes: int | None = None
    input_shapes: tuple[Any, ...] | None = None  # the tensor input shapes of that call
    # under R, what its last metered call would have saved: (input shapes, bytes, bytes large enough to swap)
    recompute_bytes: tuple[tuple[Any, ...], int, int] | None = None
    retired: bool = False  # out of the forward path, waiting for its in-flight backwards (a streamed move)

    def recomputed(self, seconds: float) -> None:
        """One of its calls ran again in a backward, taking ``seconds``."""
        self.recompute_s += seconds
        self.recomputes += 1

    def retire(self) -> None:
        """It left the forward path: later micro-batches do not run it."""
        self.retired = True

    def attach(self, pre: Callable[..., None], post: Callable[..., None]) -> None:
        self.has_buffers = any(True for _ in self.module.buffers())
        self._pre, self._post = pre, post
        self.hook()

    def hook(self) -> None:
        """Put the layer's hooks on (again): its calls are seen."""
        if not self.hooks:
            self.hooks.append(self.module.register_forward_pre_hook(self._pre))
            self.hooks.append(self.module.register_forward_hook(self._post, prepend=True, always_call=True))

    def unhook(self) -> None:
        """Take the layer's hooks off: its calls run as without vpipe (its routed forward, if any, stays)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def detach(self) -> None:
        self.unhook()
        self.restore_forward()

    def use_policy(self, policy: Policy, route: Callable[[ManagedLayer, Callable[..., Any], tuple, dict], Any]
                   ) -> None:
        """Take ``policy`` from the layer's next call: under R its forward goes through ``route``."""
        self.policy = policy
        if policy is Policy.RECOMPUTE:
            forget_weight_places(self.module)  # found anew at its first recompute call
            self.route_forward(route)
        else:
            self.restore_forward()

    def route_forward(self, route: Callable[[ManagedLayer, Callable[..., Any], tuple, dict], Any]) -> None:
        """Set the instance attribute ``forward`` to ``route(layer, original_forward, args, kwargs)``."""
        if self.wrapper is not None:
            return
        module = self.module
        self.original_forward = module.__dict__.get("forward", _MISSING)
        inner = module.forward  # the bound method, or an instance attribute someone set before

        def forward(*args: Any, **kwargs: Any) -> Any:
            return route(self, inner, args, kwargs)

        setattr(forward, ROUTED_FORWARD, True)
        self.wrapper = forward
        module.forward = forward

    def restore_forward(self) -> None:
        if self.wrapper is None:
            return
        module = self.module
        if module.__dict__.get("forward") is not self.wrapper:
            raise RuntimeError(
                f"layer {self.layer_id}: its forward attribute was replaced after vpipe "
                f"set it for recompute; vpipe cannot restore the module without undoing that change"
            )
        if self.original_forward is _MISSING:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = self.original_forward
        self.wrapper = None
        self.original_forward = _MISSING


class LayerCall:
    """One managed call of a layer inside a micro-batch's forward: what it saved."""

    __slots__ = ("layer", "mb", "policy", "inputs", "t0", "entries", "bytes", "new_bytes", "first_seq",
                 "swappable",
                 "counter", "buffers")

    def __init__(self, layer: ManagedLayer, mb: int, args: tuple[Any, ...], first_seq: int = 0) -> None:
        self.layer = layer
        self.mb = mb
        self.first_seq = first_seq  # the storage entries numbered from here on are this call's
        self.policy = layer.policy  # read once per call: a plan may change it between micro-batches
        self.inputs = args
        self.entries: set[StorageEntry] = set()  # addresses can be reused within a call: count entries
        self.bytes = 0
        self.new_bytes = 0  # of those, the storages no earlier layer of this micro-batch saved
        self.swappable = 0
        self.counter: RecomputeCounter | None = None
        self.buffers: frozenset[int] = (
            frozenset(local_of(b).untyped_storage().data_ptr() for b in layer.module.buffers())
                                        if layer.has_buffers
            else frozenset()
        )
        self.t0 = time.perf_counter()

    def is_weight(self, t: torch.Tensor) -> bool:
        """Parameters, views of them, stashed weight versions (leaves that require grad), buffers."""
        base = view_base(t)
        root = t if base is None else base
        # (not root.grad_fn: that would give the node a Python object; see without_graph)
        if not root.is_leaf:
            return False  # computed in this forward: an activation
        if root.requires_grad or root.__class__ is nn.Parameter:
            return not any(root is a for a in self.inputs)  # a stage input is an activation
        return bool(self.buffers) and local_of(t).untyped_storage().data_ptr() in self.buffers

    def input_bytes(self) -> int:
        """What a recompute of this call would keep instead of its activations: its tensor inputs."""
        return sum(local_of(a).untyped_storage().nbytes() for a in self.inputs if isinstance(a, torch.Tensor))


class KeptCall:
    """A kept layer's call that runs without saved-tensor hooks (its bytes are counted as last metered)."""

    __slots__ = ("layer", "mb", "t0")

    def __init__(self, layer: ManagedLayer, mb: int) -> None:
        self.layer = layer
        self.mb = mb
        self.t0 = time.perf_counter()


def input_shapes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The shapes of a call's tensor arguments (an unmetered call must match the metered one's)."""
    return tuple(a.shape for a in args if isinstance(a, torch.Tensor))
