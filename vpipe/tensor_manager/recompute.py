"""Policy R: drop what a layer saves and run its forward again in the backward, once.

During the original forward every tensor autograd saves inside the layer is replaced by a
*slot* (saved-tensor hooks); the layer's tensor inputs are saved instead, with what it
takes to run the call again identically (:mod:`.replay`). The first unpack of a slot runs
the forward again and fills every slot still needed; the recompute stops as soon as the
last of them is filled.

Why not ``torch.utils.checkpoint``: non-reentrant checkpoint keys its recomputed tensors
by autograd graph task and recomputes once per task. A zero-bubble backward unpacks the
same saved tensors in several tasks: ``stage_backward_input`` is one, and
``stage_backward_weight`` runs one ``autograd.grad`` per parameter group, so a
transformer block was recomputed 7 times per micro-batch (measured, torch 2.13), and the
recomputed tensors of the first task that the weight pass needed were freed after their
first use. Here a slot's recomputed tensor lives until its last expected unpack:

* in the input-gradient pass (phase ``"input"``), a slot unpacked by an autograd node that
  will run again in the weight pass (the manager asks autograd, see
  :meth:`.current_pass.CurrentPass.needed_by_weight_pass`) keeps its tensor; every other slot
  drops it right after its unpack;
* in the weight pass, the kept tensor serves the unpack and is dropped; a slot that lost
  its tensor (the budget dropped it, or a wrong guess) is recomputed again, counted as a
  repeat;
* in a plain backward (``"full"``) each slot drops its tensor after its unpack, as
  checkpoint does; a second ``retain_graph`` pass recomputes again.

The recomputed tensors a call holds are counted in the manager's ledger (one count per
storage; a slot on one of the layer's own inputs costs nothing more: the input is saved
and counted already), so a budget sees what waits for a weight pass. Parameters, buffers
and stashed weight versions the layer saves are kept as they are (autograd holds them
anyway; there is nothing to recompute).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vpipe import timeline
from vpipe.tensor_manager.accounting import Ledger, local_of
from vpipe.tensor_manager.replay import Replay, SavedTensorHooks

__all__ = ["RecomputeFrame", "FrameSupport", "Slot", "RecomputeError"]


class RecomputeError(RuntimeError):
    """The recompute saved different tensors than the original forward (a non-deterministic layer)."""


class _Stop(Exception):
    """Raised from the recompute's pack hook once the last needed slot is filled."""


def _storage_of(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a strided tensor's storage, None for layouts without one."""
    if t.layout is not torch.strided:
        return None
    storage = local_of(t).untyped_storage()
    return storage.data_ptr(), storage.nbytes()


@dataclass(frozen=True)
class FrameSupport:
    """What a recomputed call needs from the store that keeps it (one, shared by the store's calls)."""

    device: torch.device  # the stage's device: only its bytes are counted
    ledger: Ledger  # where the recomputed storages are counted, per layer and micro-batch
    released: Callable[[RecomputeFrame, int], None]  # a slot died holding storage ``key``: uncount it later
    recomputed: Callable[[int, float, bool], None]  # (layer, seconds, a repeat) after every recompute
    reading_inputs: Callable[[], AbstractContextManager[None]]  # around unpacking the saved inputs


class Slot:
    """What autograd holds for one tensor saved inside a recomputed layer."""

    __slots__ = ("frame", "index", "value", "key", "unpacked", "later", "__weakref__")

    def __init__(self, frame: RecomputeFrame, index: int) -> None:
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
            self.frame.support.released(self.frame, self.key)


class RecomputeFrame:
    """One call of a recomputed layer: how to run it again and the slots it fills."""

    __slots__ = ("support", "layer", "mb", "replay", "slots", "meta", "input_keys", "storages", "recomputes",
                 "retired", "__weakref__")

    def __init__(self, support: FrameSupport, layer: int, mb: int, module: nn.Module,
                 forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 save_inputs: SavedTensorHooks) -> None:
        self.support = support
        self.layer = layer
        self.mb = mb
        self.slots: list[weakref.ref[Slot] | None] = []  # None: a weight, which autograd holds itself
        self.meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.input_keys: frozenset[int] = frozenset()
        # address -> [bytes, slots holding it] (counted in the ledger)
        self.storages: dict[int, list[int]] = {}
        self.recomputes = 0
        self.retired = False  # the micro-batch's backward is over: nothing is recomputed any more
        self.replay = Replay(module, forward, args, kwargs, save_inputs)  # packs the inputs

    # ------------------------------------------------------------------ forward
    def pack(self, t: torch.Tensor, is_weight: bool) -> torch.Tensor | Slot:
        """A slot for an activation; a weight is returned as it is
        (autograd holds it, nothing to recompute)."""
        self.meta.append((t.shape, t.dtype, t.device))
        if is_weight:
            self.slots.append(None)
            return t
        slot = Slot(self, len(self.slots))
        self.slots.append(weakref.ref(slot))
        return slot

    # ------------------------------------------------------------------ backward
    def value_of(self, slot: Slot, phase: str) -> torch.Tensor:
        """The slot's tensor for an unpack in ``phase``, recomputed when it holds none; marks it unpacked."""
        if slot.value is None:
            if self.retired:
                raise RuntimeError(
                    f"layer {self.layer}, micro-batch {self.mb}: a recomputed tensor was unpacked after the "
                    "micro-batch's backward ended (its weight pass, or the step); the tensor manager let go "
                    "of the call's inputs then. Trying to backward through the graph a second time?")
            self.recompute(slot, phase)
        value = slot.value
        assert value is not None
        slot.unpacked = True
        return value

    def recompute(self, asked: Slot, phase: str) -> None:
        """Run the forward again; fill ``asked`` and every other slot a later unpack still needs."""
        wanted: dict[int, Slot] = {}
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
        count = added = 0  # tensors saved, bytes held (counted in the ledger once, when the recompute stops)
        meta, layer, mb = self.meta, self.layer, self.mb
        frame_ref = weakref.ref(self)

        # the recompute's own graph holds this hook until that graph dies: it reaches the frame weakly, and
        # it returns None (that graph never runs backward, so it keeps nothing alive), so a tensor no slot
        # wants (a weight, one already filled) costs no detach; a wanted one is held detached (a saved output
        # holding its own grad_fn would keep the recompute's graph alive)
        def pack(x: torch.Tensor) -> None:
            nonlocal count, added
            index, count = count, count + 1
            if index >= len(meta):
                raise RecomputeError(
                    f"layer {layer}, micro-batch {mb}: its recompute saved more tensors than its forward "
                    f"({len(meta)}); the layer's forward must save the same tensors every time it runs")
            slot = wanted.get(index)
            if slot is not None and (frame := frame_ref()) is not None:
                found = (x.shape, x.dtype, x.device)
                if found != meta[index]:
                    raise RecomputeError(
                        f"layer {layer}, micro-batch {mb}: saved tensor {index} was {meta[index]} in the "
                        f"forward and {found} in the recompute; the layer's forward is not deterministic")
                added += frame.hold(slot, x.detach() if x.requires_grad else x)
            if index == last:
                raise _Stop

        t0 = time.perf_counter()
        try:
            with timeline.span("vpipe.recompute", timeline.MEMORY, layer=layer, mb=mb, phase=phase):
                self.replay.run(args, pack)
        except _Stop:
            pass
        else:
            raise RecomputeError(
                f"layer {layer}, micro-batch {mb}: its recompute saved {count} tensors, its forward "
                f"{len(meta)}; the layer's forward must save the same tensors every time it runs")
        finally:
            wanted.clear()
            if added:
                self.support.ledger.add(layer, mb, added)
            self.recomputes += 1
            self.support.recomputed(layer, time.perf_counter() - t0, self.recomputes > 1)

    def inputs(self) -> list[Any]:
        """The call's arguments, unpacked from the saved inputs (not a use by a backward node)."""
        with self.support.reading_inputs():
            return self.replay.inputs()

    # ------------------------------------------------------------------ holding
    def hold(self, slot: Slot, value: torch.Tensor) -> int:
        """Fill ``slot``; returns the bytes of a storage no slot of this call held yet (the caller counts them
        in the ledger)."""
        slot.value = value
        found = _storage_of(value)
        if (
            found is None
            or value.device != self.support.device
            or found[0] in self.input_keys
            or found[1] == 0
        ):
            slot.key = None  # not device bytes of its own (an input of the layer is counted already)
            return 0
        key, nbytes = found
        slot.key = key
        record = self.storages.get(key)
        if record is None:
            self.storages[key] = [nbytes, 1]
            return nbytes
        record[1] += 1
        return 0

    def drop(self, slot: Slot, wanted: bool = False) -> int:
        """Let go of a slot's tensor; ``wanted``: a later pass still needs it (it recomputes).
        Returns the device bytes this freed (0 while another slot holds the storage)."""
        if slot.value is None:
            return 0
        key = slot.key
        slot.value = slot.key = None
        slot.later = wanted
        return self.release(key) if key is not None else 0

    def retire(self) -> None:
        """The micro-batch's backward is over: drop every tensor the slots hold and let go of the call's
        inputs and state (autograd may keep slots alive longer, in a graph something still refers to)."""
        for slot in list(self.live_slots()):
            self.drop(slot)
        self.retired = True
        self.replay.forget()

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
        self.support.ledger.sub(self.layer, self.mb, record[0])
        return record[0]

    def live_slots(self) -> Iterator[Slot]:
        for ref in self.slots:
            slot = ref() if ref is not None else None
            if slot is not None and slot.value is not None:
                yield slot

    @property
    def held_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.storages.values())
