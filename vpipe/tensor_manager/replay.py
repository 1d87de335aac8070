"""Running a layer's call again exactly as it first ran: same inputs, weights, RNG and autocast.

A recompute (:mod:`.recompute`) needs the call's tensor inputs, saved through the tensor
manager's own saved-tensor hooks, called directly (so they are counted, and can be swapped
under a budget; an autograd node to save them through cost two tensor operations and an
autograd Function a call), and the state the forward ran under: the
CPU and device RNG states (dropout masks are identical, so gradients equal the kept run's
bit for bit), the autocast state and the ``torch.device`` context, as
``torch.utils.checkpoint`` restores them.

Buffers: a forward in training mode may update buffers (BatchNorm's running statistics
and ``num_batches_tracked``, a user's step counter). The values the buffers had when the
call began are kept with it, the replay runs on them, and afterwards every buffer gets back
the value it had before the replay: a recompute reads what the original forward read and
leaves the buffers as the single forward left them.

Weight versions: PipeDream runs the stage through ``torch.func.functional_call`` with
stashed weight tensors; the recompute happens in the backward, after functional_call has
put the live parameters back (possibly already updated). The weights in effect at forward
time are captured and, if they are no longer the module's, the call runs on them again
through functional_call.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import DefaultDeviceType, get_device_states, set_device_states

from vpipe.compat.torch_internals import (
    active_device_context,
    buffer_table,
    device_initialized,
    get_autocast_kwargs,
    get_device_module,
    infer_device_type,
    parameter_table,
)

__all__ = ["Replay", "SavedTensorHooks", "capture_weights", "forget_weight_places"]

# (pack, unpack): the saved-tensor hooks a call's inputs are saved through
SavedTensorHooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


# Where each module's parameters and buffers live: (qualified name, the owning dict, key). Walking the
# module tree for every recomputed call (twice) cost more Python than the rest of the call's bookkeeping;
# the places are found once per module and read at every call (functional_call swaps the tensors in
# those same dicts). forget_weight_places() drops a module's entry when vpipe starts managing it.
_Place = tuple[str, dict[str, Any], str, bool]  # (qualified name, owning dict, key, is a buffer)
_places: weakref.WeakKeyDictionary[nn.Module, list[_Place]] = weakref.WeakKeyDictionary()


def _weight_places(module: nn.Module) -> list[_Place]:
    places = _places.get(module)
    if places is None:
        places = []
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for table, is_buffer in ((parameter_table(sub), False), (buffer_table(sub), True)):
                places.extend((f"{prefix}.{key}" if prefix else key, table, key, is_buffer) for key in table)
        _places[module] = places
    return places


def _buffers(module: nn.Module) -> list[torch.Tensor]:
    """The module's buffers now, each once."""
    found: dict[int, torch.Tensor] = {}
    for _, table, key, is_buffer in _weight_places(module):
        if is_buffer and (t := table[key]) is not None:
            found.setdefault(id(t), t)
    return list(found.values())


def forget_weight_places(module: nn.Module) -> None:
    """Find the module's parameters and buffers anew at its next call (its structure may have changed)."""
    _places.pop(module, None)


def capture_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameter and buffer tensors the module uses right now (stashed ones under functional_call)."""
    return {name: t for name, table, key, _ in _weight_places(module) if (t := table[key]) is not None}


def _same_weights(module: nn.Module, captured: dict[str, torch.Tensor]) -> bool:
    now = capture_weights(module)
    return now.keys() == captured.keys() and all(now[k] is t for k, t in captured.items())


def _identity(x: Any) -> Any:
    return x


# arguments a layer's call takes beside tensors whose devices need no search (a container may hold tensors)
_FLAT = (torch.Tensor, int, float, bool, str, type(None))


def _device_states(args: tuple[Any, ...]) -> tuple[str, list[int], list[torch.Tensor]]:
    """The device type whose RNG the call may draw from, and the RNG state of each device its tensors are on.

    What ``torch.utils.checkpoint`` captures (CUDA first among device types, its default without
    one), each device once; for flat arguments (a layer's usual call) without its walks over the
    arguments' trees, three per call where one device's states are taken.
    """
    if not all(isinstance(a, _FLAT) for a in args):
        return _device_states_in_trees(args)
    types: dict[str, None] = {}
    devices: dict[int, None] = {}
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            types[a.device.type] = None
            if a.device.type != "meta":
                devices[a.get_device()] = None
    if len(types) > 1:  # torch's own warns that only one device type's states are kept
        return _device_states_in_trees(args)
    device_type = next(iter(types), None) or DefaultDeviceType.get_device_type()
    module = get_device_module(device_type)
    if not devices or not device_initialized(module):
        return device_type, [], []
    states = []
    for index in devices:
        with module.device(index):
            states.append(module.get_rng_state())
    return device_type, list(devices), states


def _device_states_in_trees(args: tuple[Any, ...]) -> tuple[str, list[int], list[torch.Tensor]]:
    """:func:`_device_states` by torch's own functions, which look into containers."""
    device_type = infer_device_type(*args)
    if not device_initialized(get_device_module(device_type)):
        return device_type, [], []
    devices, states = get_device_states(*args)
    each = dict(zip(devices, states))  # (torch's lists a device once per tensor on it; the states are equal)
    return device_type, list(each), list(each.values())


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for the CPU or ``device_type`` (off, a replay needs no autocast context)."""
    return torch.is_autocast_enabled("cpu") or (
        torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type))


def _autocast_off(device_type: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Autocast arguments that turn it off, as ``get_autocast_kwargs`` gives them."""
    return ({"enabled": False} if torch.amp.is_autocast_available(device_type) else None), {"enabled": False}


def _device_context() -> contextlib.AbstractContextManager[Any]:
    """The ``torch.device`` context the forward ran under, if any (the recompute must allocate alike)."""
    context = active_device_context()
    return contextlib.nullcontext() if context is None else context


class Replay:
    """One call of a layer, captured when it runs: its inputs (packed by ``hooks``) and its state."""

    __slots__ = ("module", "forward", "captured", "kwargs", "layout", "unpack", "saved", "device_type",
                 "cpu_rng",
                 "device_rng", "rng_devices", "autocast", "device_ctx", "buffers")

    def __init__(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], hooks: SavedTensorHooks) -> None:
        self.module = module
        self.forward = forward
        self.captured = capture_weights(module)
        self.kwargs = kwargs
        self.layout = [None if isinstance(a, torch.Tensor) else a for a in args]
        # the state the original forward ran under, to run it again identically (as checkpoint does)
        self.device_type, self.rng_devices, self.device_rng = _device_states(args)
        self.autocast = get_autocast_kwargs(self.device_type) if _autocast_on(self.device_type) else None
        self.cpu_rng = torch.get_rng_state()
        self.device_ctx = _device_context()
        # each buffer with its value when the call began (the forward may update it: BatchNorm statistics)
        self.buffers = [(b, b.detach().clone()) for b in _buffers(module)]
        pack, self.unpack = hooks
        # each tensor input packed, and whether it required grad: autograd saves only what the gradients
        # asked for need, so the recompute's inputs must ask for the same
        self.saved = [(pack(a), a.requires_grad) for a in args if isinstance(a, torch.Tensor)]

    def forget(self) -> None:
        """Let go of the packed inputs, keyword arguments and buffer values: the call will not run again."""
        self.saved = []
        self.kwargs = {}
        self.buffers = []

    def inputs(self) -> list[Any]:
        """The call's arguments again (the tensors unpacked, requiring grad as the originals did)."""
        unpack, saved = self.unpack, iter(self.saved)
        args = []
        for a in self.layout:
            if a is None:
                packed, requires_grad = next(saved)
                a = unpack(packed)
                if requires_grad and not a.requires_grad:  # (held without its graph: a leaf of the recompute)
                    a = a.detach().requires_grad_()
            args.append(a)
        return args

    def run(self, args: list[Any], pack: Callable[[torch.Tensor], Any]) -> None:
        """Call the forward on ``args`` under the original state, with ``pack`` as its saved-tensor hook.

        The buffers and RNG states are set and put back by hand, and autocast is entered only when it
        is on at the call or now: torch's context managers for these (``fork_rng``, an autocast per
        device type) cost 40 us a call on a 2-core host, more than the rest of the replay's own work.
        """
        buffers_now = self._buffers_to_call() if self.buffers else None
        rng_now = self._rng_now()
        try:
            self._set_rng(self.cpu_rng, self.device_rng)
            with torch.autograd.graph.saved_tensors_hooks(pack,
                                                          _identity), torch.enable_grad(), self.device_ctx:
                if self.autocast is None and not _autocast_on(self.device_type):
                    self._call(args)
                else:
                    device_kwargs, cpu_kwargs = self.autocast or _autocast_off(self.device_type)
                    device_autocast = (torch.amp.autocast(device_type=self.device_type, **device_kwargs)
                                       if device_kwargs is not None else contextlib.nullcontext())
                    with device_autocast, torch.amp.autocast("cpu", **cpu_kwargs):
                        self._call(args)
        finally:
            self._set_rng(*rng_now)
            if buffers_now is not None:
                for (b, _), value in zip(self.buffers, buffers_now):
                    b.data.copy_(value)

    def _call(self, args: list[Any]) -> None:
        if _same_weights(self.module, self.captured):
            self.forward(*args, **self.kwargs)
        else:
            functional_call(self.module, self.captured, tuple(args), self.kwargs)

    def _buffers_to_call(self) -> list[torch.Tensor]:
        """The buffers as the original call found them; returns their values now (written through ``.data``:
        the autograd graphs that saved a buffer see no in-place change)."""
        now = [b.detach().clone() for b, _ in self.buffers]
        for b, at_call in self.buffers:
            b.data.copy_(at_call)
        return now

    def _rng_now(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The CPU RNG state and those of the call's devices now (what ``torch.random.fork_rng`` keeps)."""
        if not self.rng_devices:
            return torch.get_rng_state(), []
        module = get_device_module(self.device_type)
        return torch.get_rng_state(), [module.get_rng_state(d) for d in self.rng_devices]

    def _set_rng(self, cpu: torch.Tensor, devices: list[torch.Tensor]) -> None:
        """Set the CPU RNG state and those of the call's devices (as ``torch.utils.checkpoint`` does)."""
        torch.set_rng_state(cpu)
        if devices:
            set_device_states(self.rng_devices, devices, device_type=self.device_type)
