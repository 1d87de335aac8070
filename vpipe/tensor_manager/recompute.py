"""Policy R: drop what a layer saves and run its forward again in the backward, once.

During the original forward every tensor autograd saves inside the layer is replaced by a
*slot* (saved-tensor hooks); the layer's tensor inputs are saved instead, through the
tensor manager's own hooks (so they are counted, and can be swapped under a budget). The
first unpack of a slot runs the forward again on those inputs with the CPU and device RNG
states and the autocast state of the original forward (dropout masks are identical, so
gradients equal the kept run's bit for bit) and fills every slot still needed; the
recompute stops as soon as the last of them is filled.

Why not ``torch.utils.checkpoint``: non-reentrant checkpoint keys its recomputed tensors
by autograd graph task and recomputes once per task. A zero-bubble backward unpacks the
same saved tensors in several tasks: ``stage_backward_input`` is one, and
``stage_backward_weight`` runs one ``autograd.grad`` per parameter group, so a
transformer block was recomputed 7 times per micro-batch (measured, torch 2.13), and the
recomputed tensors of the first task that the weight pass needed were freed after their
first use. Here a slot's recomputed tensor lives until its last expected unpack:

* in the input-gradient pass (phase ``"input"``), a slot unpacked by an autograd node that
  will run again in the weight pass (the manager asks autograd, see
  ``TensorManager._needed_by_weight_pass``) keeps its tensor; every other slot drops it
  right after its unpack;
* in the weight pass, the kept tensor serves the unpack and is dropped; a slot that lost
  its tensor (the budget dropped it, or a wrong guess) is recomputed again, counted as a
  repeat;
* in a plain backward (``"full"``) each slot drops its tensor after its unpack, as
  checkpoint does; a second ``retain_graph`` pass recomputes again.

The recomputed tensors the store holds are counted in the manager's ledger (one count per
storage; a slot on one of the layer's own inputs costs nothing more: the input is saved
and counted already), so a budget sees what waits for a weight pass.

Parameters, buffers and stashed weight versions the layer saves are kept as they are
(autograd holds them anyway; there is nothing to recompute). Two more things vpipe needs:

* Weight versions. PipeDream runs the stage through ``torch.func.functional_call`` with
  stashed weight tensors; the recompute happens in the backward, after functional_call
  has put the live parameters back (possibly already updated). The weights in effect at
  forward time are captured and, if they are no longer the module's, the recompute runs
  on them again through functional_call.
* Measuring. The store's hooks see every tensor the layer saves, so a
  :class:`RecomputeCounter` learns how many bytes the layer would save: a budget needs
  that number for recomputed layers too.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import (
    _get_autocast_kwargs,
    _get_device_module,
    _infer_device_type,
    get_device_states,
    set_device_states,
)

from vpipe.tensor_manager.accounting import Ledger

__all__ = ["RecomputeStore", "RecomputeCounter", "capture_weights"]


def capture_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameter and buffer tensors the module uses right now (stashed ones under functional_call)."""
    found = {name: t for name, t in module.named_parameters(remove_duplicate=False)}
    found.update({name: t for name, t in module.named_buffers(remove_duplicate=False) if t is not None})
    return found


def _same_weights(module: nn.Module, captured: dict[str, torch.Tensor]) -> bool:
    now = capture_weights(module)
    return now.keys() == captured.keys() and all(now[k] is t for k, t in captured.items())


class RecomputeCounter:
    """Bytes a recomputed forward saves (distinct storages, weights excluded)."""

    def __init__(self, is_weight: Callable[[torch.Tensor], bool], min_swap_bytes: int) -> None:
        self._is_weight = is_weight
        self._min_swap = min_swap_bytes
        # nothing is kept, so a storage can die and its address be reused within the
        # forward: a weak reference tells a new storage from one seen before
        self._seen: dict[int, StorageWeakRef] = {}
        self.bytes = 0
        self.swappable = 0

    def see(self, t: torch.Tensor) -> None:
        if self._is_weight(t) or t.layout is not torch.strided:
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        seen = self._seen.get(key)
        if seen is not None and not seen.expired():
            return
        self._seen[key] = StorageWeakRef(storage)
        n = storage.nbytes()
        self.bytes += n
        if n >= self._min_swap:
            self.swappable += n


class RecomputeError(RuntimeError):
    """The recompute saved different tensors than the original forward (a non-deterministic layer)."""


class _Stop(Exception):
    """Raised from the recompute's pack hook once the last needed slot is filled."""


class _SaveInputs(torch.autograd.Function):
    """Saves the layer's tensor inputs through whatever saved-tensor hooks are active (the manager's).

    Its output is never used, so its backward never runs: the node only holds the saved
    inputs for as long as the recompute frame (and so some slot) is alive.
    """

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[None, ...]:  # pragma: no cover - never reached
        return (None,) * len(ctx.needs_input_grad)


def _storage_of(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a strided tensor's storage, None for layouts without one."""
    if t.layout is not torch.strided:
        return None
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class _Slot:
    """What autograd holds for one tensor saved inside a recomputed layer."""

    __slots__ = ("frame", "index", "value", "key", "unpacked", "later", "__weakref__")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index
        self.value: torch.Tensor | None = None  # the recomputed tensor, while it is needed
        self.key: int | None = None  # its storage address while counted in the frame
        self.unpacked = False  # unpacked at least once
        self.later = False  # unpacked in the input pass; the weight pass unpacks it again

    def __del__(self) -> None:
        # autograd released it (after its last backward) while it still held a tensor: the
        # bytes leave the ledger at the store's next drain (this may run on autograd's thread)
        if self.value is not None and self.key is not None:
            self.frame.store.dead.append((self.frame, self.key))


class _Frame:
    """One call of a recomputed layer: how to run it again and the slots it fills."""

    __slots__ = ("store", "layer", "mb", "module", "forward", "captured", "kwargs", "layout", "saver", "slots",
                 "meta", "input_keys", "storages", "recomputes", "device_type", "cpu_rng", "device_rng",
                 "rng_devices", "autocast", "device_ctx", "__weakref__")

    def __init__(self, store: RecomputeStore, layer: int, mb: int, module: nn.Module,
                 forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.store = store
        self.layer = layer
        self.mb = mb
        self.module = module
        self.forward = forward
        self.captured = capture_weights(module)
        self.kwargs = kwargs
        self.layout = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.saver: torch.Tensor | None = None
        self.slots: list[weakref.ref[_Slot] | None] = []  # None: a weight, which autograd holds itself
        self.meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.input_keys: frozenset[int] = frozenset()
        self.storages: dict[int, list[int]] = {}  # address -> [bytes, slots holding it] (counted in the ledger)
        self.recomputes = 0
        # the state the original forward ran under, to run it again identically (as checkpoint does)
        self.device_type = _infer_device_type(*args)
        self.autocast = _get_autocast_kwargs(self.device_type)
        self.cpu_rng = torch.get_rng_state()
        self.rng_devices: list[int] = []
        self.device_rng: list[torch.Tensor] = []
        if getattr(_get_device_module(self.device_type), "_initialized", False):
            self.rng_devices, self.device_rng = get_device_states(*args)
        self.device_ctx = _device_context()

    # ------------------------------------------------------------------ forward
    def pack(self, t: torch.Tensor, is_weight: bool) -> torch.Tensor | _Slot:
        """A slot for an activation; a weight is returned as it is (autograd holds it, nothing to recompute)."""
        self.meta.append((t.shape, t.dtype, t.device))
        if is_weight:
            self.slots.append(None)
            return t
        slot = _Slot(self, len(self.slots))
        self.slots.append(weakref.ref(slot))
        return slot

    # ------------------------------------------------------------------ backward
    def unpack(self, slot: _Slot | torch.Tensor) -> torch.Tensor:
        if isinstance(slot, torch.Tensor):
            return slot  # a weight
        store = self.store
        with store.lock:
            store.drain()
            phase = store.phase()
            if slot.value is None:
                self.recompute(slot, phase)
            value = slot.value
            assert value is not None
            slot.unpacked = True
            slot.later = phase == "input" and store.needed_later()
            if not slot.later:
                self.drop(slot)
            elif not store.may_keep(self.transient_bytes()):
                # over the budget: the weight pass recomputes it (the slot stays flagged as wanted)
                store.dropped_for_budget(self.layer, self.drop(slot, wanted=True))
            return value

    def recompute(self, asked: _Slot, phase: str) -> None:
        """Run the forward again; fill ``asked`` and every other slot a later unpack still needs."""
        wanted: dict[int, _Slot] = {}
        for ref in self.slots:
            slot = ref() if ref is not None else None
            if slot is None or slot.value is not None:
                continue
            # the weight pass unpacks only what it flagged or never saw: an input-only slot stays empty
            if slot is asked or phase != "weight" or not slot.unpacked or slot.later:
                wanted[slot.index] = slot
        last = max(wanted)
        args = self.inputs()
        self.input_keys = frozenset(found[0] for a in args if isinstance(a, torch.Tensor)
                                    and (found := _storage_of(a)) is not None)
        count = 0
        meta, layer, mb = self.meta, self.layer, self.mb
        frame_ref = weakref.ref(self)

        # the recompute's own graph holds this hook (and what it returns) until that graph dies: it
        # returns detached tensors (a saved output holding its own grad_fn would be a reference
        # cycle) and reaches the frame weakly
        def pack(x: torch.Tensor) -> torch.Tensor:
            nonlocal count
            index, count = count, count + 1
            if index >= len(meta):
                raise RecomputeError(
                    f"layer {layer}, micro-batch {mb}: its recompute saved more tensors than its forward "
                    f"({len(meta)}); the layer's forward must save the same tensors every time it runs")
            value = x.detach() if x.requires_grad else x
            slot = wanted.get(index)
            frame = frame_ref()
            if slot is not None and frame is not None:
                found = (x.shape, x.dtype, x.device)
                if found != meta[index]:
                    raise RecomputeError(
                        f"layer {layer}, micro-batch {mb}: saved tensor {index} was {meta[index]} in the forward "
                        f"and {found} in the recompute; the layer's forward is not deterministic")
                frame.hold(slot, value)
            if index == last:
                raise _Stop
            return value

        t0 = time.perf_counter()
        try:
            with self._replay(), torch.autograd.graph.saved_tensors_hooks(pack, _identity), torch.enable_grad():
                if _same_weights(self.module, self.captured):
                    self.forward(*args, **self.kwargs)
                else:
                    functional_call(self.module, self.captured, tuple(args), self.kwargs)
        except _Stop:
            pass
        else:
            raise RecomputeError(
                f"layer {layer}, micro-batch {mb}: its recompute saved {count} tensors, its forward "
                f"{len(meta)}; the layer's forward must save the same tensors every time it runs")
        finally:
            wanted.clear()
            self.recomputes += 1
            self.store.on_recompute(layer, time.perf_counter() - t0, self.recomputes > 1)

    def inputs(self) -> list[Any]:
        assert self.saver is not None and self.saver.grad_fn is not None
        store = self.store
        store.unpacking_inputs += 1
        try:
            tensors = iter(self.saver.grad_fn.saved_tensors)  # type: ignore[attr-defined]
        finally:
            store.unpacking_inputs -= 1
        return [next(tensors) if a is None else a for a in self.layout]

    @contextlib.contextmanager
    def _replay(self) -> Iterator[None]:
        """The RNG, autocast and device-context state of the original forward (restored after)."""
        device_autocast, cpu_autocast = self.autocast
        with torch.random.fork_rng(devices=self.rng_devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu_rng)
            if self.rng_devices:
                set_device_states(self.rng_devices, self.device_rng, device_type=self.device_type)
            device_ctx = (torch.amp.autocast(device_type=self.device_type, **device_autocast)
                          if device_autocast is not None else contextlib.nullcontext())
            with device_ctx, torch.amp.autocast("cpu", **cpu_autocast), self.device_ctx:
                yield

    # ------------------------------------------------------------------ holding
    def hold(self, slot: _Slot, value: torch.Tensor) -> None:
        slot.value = value
        found = _storage_of(value)
        if found is None or value.device != self.store.device or found[0] in self.input_keys or found[1] == 0:
            slot.key = None  # not device bytes of its own (an input of the layer is counted already)
            return
        key, nbytes = found
        slot.key = key
        record = self.storages.get(key)
        if record is None:
            self.storages[key] = [nbytes, 1]
            self.store.ledger.add(self.layer, self.mb, nbytes)
        else:
            record[1] += 1

    def drop(self, slot: _Slot, wanted: bool = False) -> int:
        """Let go of a slot's tensor; ``wanted``: a later pass still needs it (it recomputes).
        Returns the device bytes this freed (0 while another slot holds the storage)."""
        if slot.value is None:
            return 0
        key = slot.key
        slot.value = slot.key = None
        slot.later = wanted
        return self.release(key) if key is not None else 0

    def transient_bytes(self) -> int:
        """Bytes of this call's recomputed storages that no slot keeps for a later pass (they go soon)."""
        kept = {slot.key for slot in self.live_slots() if slot.later}
        return sum(nbytes for key, (nbytes, _) in self.storages.items() if key not in kept)

    def release(self, key: int) -> int:
        """One slot less holds storage ``key``; returns its bytes if that was the last."""
        record = self.storages[key]
        record[1] -= 1
        if record[1]:
            return 0
        del self.storages[key]
        self.store.ledger.sub(self.layer, self.mb, record[0])
        return record[0]

    def live_slots(self) -> Iterator[_Slot]:
        for ref in self.slots:
            slot = ref() if ref is not None else None
            if slot is not None and slot.value is not None:
                yield slot

    @property
    def held_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.storages.values())


def _identity(x: Any) -> Any:
    return x


def _device_context() -> contextlib.AbstractContextManager[Any]:
    """The ``torch.device`` context the forward ran under, if any (the recompute must allocate alike)."""
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:  # pragma: no cover - every supported torch has both
        return contextlib.nullcontext()
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode
    return contextlib.nullcontext()


class RecomputeStore:
    """The recomputed layer calls of one tensor manager, per micro-batch, and what they hold.

    ``phase()`` names the backward pass running now (``"full"``, ``"input"`` or
    ``"weight"``); ``needed_later()`` says whether the autograd node unpacking now runs
    again in the weight pass; ``may_keep(transient)`` whether a tensor may stay for it
    within the budget (``transient``: held bytes about to go); ``on_recompute(layer,
    seconds, repeat)`` is told of every recompute (``repeat``: the call had been
    recomputed before).
    """

    def __init__(self, device: torch.device, ledger: Ledger, lock: threading.RLock, *,
                 phase: Callable[[], str], needed_later: Callable[[], bool], may_keep: Callable[[int], bool],
                 on_recompute: Callable[[int, float, bool], None]) -> None:
        self.device = device
        self.ledger = ledger
        self.lock = lock
        self.phase = phase
        self.needed_later = needed_later
        self.may_keep = may_keep
        self.on_recompute = on_recompute
        self.dead: deque[tuple[_Frame, int]] = deque()
        self.unpacking_inputs = 0  # > 0 while a recompute unpacks its inputs (not a use by a backward node)
        self._frames: dict[int, weakref.WeakSet[_Frame]] = {}
        self.dropped = 0  # recomputed tensors kept for a weight pass, dropped to stay under the budget
        self.dropped_bytes: dict[int, int] = {}  # layer -> bytes of such tensors

    def run(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
            layer: int, mb: int, counter: RecomputeCounter, is_weight: Callable[[torch.Tensor], bool]) -> Any:
        """``forward(*args, **kwargs)`` with what it saves replaced by slots, recomputed in the backward.

        ``is_weight`` tells parameters (and stashed weight versions, buffers) from activations:
        those are saved as they are, never recomputed.
        """
        frame = _Frame(self, layer, mb, module, forward, args, kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # the dummy requires grad so the saver always gets a node that holds the saved inputs
        frame.saver = _SaveInputs.apply(torch.empty(0, requires_grad=True), *tensors)

        # autograd keeps the pack hook with every tensor saved through it: after the forward it must
        # not hold the counter or ``is_weight`` (the layer call and its inputs) any longer
        measuring = [(counter, is_weight)]

        def pack(t: torch.Tensor) -> torch.Tensor | _Slot:
            see, weight = measuring[0]
            see.see(t)
            return frame.pack(t, weight(t))

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, frame.unpack):
                out = forward(*args, **kwargs)
        finally:
            measuring.clear()
        with self.lock:
            self._frames.setdefault(mb, weakref.WeakSet()).add(frame)
        return out

    def drain(self) -> None:
        """Uncount the tensors of slots autograd released while they held one."""
        with self.lock:
            while self.dead:
                frame, key = self.dead.popleft()
                frame.release(key)

    def _frames_of(self, mb: int) -> list[_Frame]:
        frames = self._frames.get(mb)
        if frames is None:
            return []
        alive = list(frames)
        if not alive:
            del self._frames[mb]
        return alive

    def end_phase(self, mb: int, phase: str, unpacked: bool) -> dict[int, int]:
        """A backward pass of ``mb`` ended: drop what no later pass needs; per layer, the bytes kept.

        After the input pass a slot keeps its tensor if the weight pass will unpack it, or if
        it was filled and never unpacked while the pass did unpack something (only the weight
        pass uses it: a saved tensor of an op on the weights alone). After any other pass
        nothing is kept.
        """
        held: dict[int, int] = {}
        with self.lock:
            self.drain()
            for frame in self._frames_of(mb):
                for slot in list(frame.live_slots()):
                    if phase == "input" and (slot.later or (unpacked and not slot.unpacked)):
                        continue
                    frame.drop(slot)
                if phase == "input" and frame.storages:
                    held[frame.layer] = held.get(frame.layer, 0) + frame.held_bytes
        return held

    def held_bytes(self, mb: int) -> int:
        """Device bytes of recomputed tensors ``mb`` holds now."""
        with self.lock:
            self.drain()
            return sum(frame.held_bytes for frame in self._frames_of(mb))

    def drop_held(self, mb: int, nbytes: int) -> int:
        """Drop recomputed tensors ``mb`` keeps for its weight pass, largest storage first, until
        ``nbytes`` are freed (the weight pass recomputes them); returns the bytes freed."""
        freed = 0
        with self.lock:
            self.drain()
            storages = sorted(((record[0], frame, key) for frame in self._frames_of(mb)
                               for key, record in frame.storages.items()), key=lambda s: -s[0])
            for size, frame, key in storages:
                if freed >= nbytes:
                    break
                for slot in list(frame.live_slots()):
                    if slot.key == key:
                        self.dropped_for_budget(frame.layer, frame.drop(slot, wanted=True))
                freed += size
        return freed

    def dropped_for_budget(self, layer: int, nbytes: int) -> None:
        self.dropped += 1
        self.dropped_bytes[layer] = self.dropped_bytes.get(layer, 0) + nbytes
