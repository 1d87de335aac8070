"""The recomputed layer calls of one tensor manager, per micro-batch, and what they hold.

:meth:`RecomputeStore.run` is the forward of a layer under R (its saved tensors become
slots, :mod:`.recompute`). The store keeps those calls per micro-batch so that the end of a
backward pass can drop the recomputed tensors no later pass needs, and, under a budget,
what a micro-batch waiting for its weight pass holds can be measured and dropped (the
weight pass recomputes it then, counted as a repeat).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from vpipe.tensor_manager.accounting import Ledger, RecomputeCounter
from vpipe.tensor_manager.recompute import FrameSupport, RecomputeFrame, Slot
from vpipe.tensor_manager.replay import SavedTensorHooks

__all__ = ["RecomputeStore", "UnpackingPass"]


class UnpackingPass(Protocol):
    """What the store asks of the backward pass running now (:class:`.current_pass.CurrentPass`)."""

    def unpack_phase(self) -> str:
        """``"full"``, ``"input"`` or ``"weight"``."""

    def needed_by_weight_pass(self) -> bool:
        """Whether the autograd node unpacking now runs again in the weight pass."""

    def reading_inputs(self) -> AbstractContextManager[None]:
        """Around a recompute unpacking its saved inputs (not a backward node's unpack)."""


class RecomputeStore:
    """The recomputed layer calls of one tensor manager, per micro-batch, and what they hold.

    ``current`` is the backward pass unpacking; ``may_keep(transient)`` whether a tensor may
    stay for the weight pass within the budget (``transient``: held bytes about to go);
    ``on_recompute(layer, seconds)`` is told of every recompute.
    """

    def __init__(self, device: torch.device, ledger: Ledger, lock: threading.RLock, *, current: UnpackingPass,
                 may_keep: Callable[[int], bool], on_recompute: Callable[[int, float], None]) -> None:
        self.device = device
        self.ledger = ledger
        self.lock = lock
        self._current = current
        self.may_keep = may_keep
        self.on_recompute = on_recompute
        self.dead: deque[tuple[RecomputeFrame, int]] = deque()
        self._frames: dict[int, weakref.WeakSet[RecomputeFrame]] = {}
        self.recompute_s = 0.0  # total time spent recomputing
        self.repeat_recomputes = 0  # recomputes of a call beyond its first
        self.dropped = 0  # recomputed tensors kept for a weight pass, dropped to stay under the budget
        self.dropped_bytes: dict[int, int] = {}  # layer -> bytes of such tensors
        self._support = FrameSupport(device, ledger, self._released, self.recomputed, current.reading_inputs)

    def run(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any], *,
            layer: int, mb: int, counter: RecomputeCounter | None, is_weight: Callable[[torch.Tensor], bool],
            save_inputs: SavedTensorHooks) -> Any:
        """``forward(*args, **kwargs)`` with what it saves replaced by slots, recomputed in the backward.

        ``is_weight`` tells parameters (and stashed weight versions, buffers) from activations:
        those are saved as they are, never recomputed; ``counter`` (None: not measured this call)
        sees every tensor the call saves; ``save_inputs`` packs the call's tensor inputs (the manager's
        own hooks: they are counted, and a budget may swap them).
        """
        frame = RecomputeFrame(self._support, layer, mb, module, forward, args, kwargs, save_inputs)

        # autograd keeps the pack hook with every tensor saved through it: after the forward it must
        # not hold the counter or ``is_weight`` (the layer call and its inputs) any longer
        measuring = [(counter, is_weight)]

        def pack(t: torch.Tensor) -> torch.Tensor | Slot:
            see, weight = measuring[0]
            if see is not None:
                see.see(t)
            return frame.pack(t, weight(t))

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, functools.partial(self._unpack, frame)):
                out = forward(*args, **kwargs)
        finally:
            measuring.clear()
        with self.lock:
            frames = self._frames.get(mb)
            if frames is None:  # (not setdefault: a WeakSet built at every call costs more than the rest)
                frames = self._frames[mb] = weakref.WeakSet()
            frames.add(frame)
        return out

    def _unpack(self, frame: RecomputeFrame, packed: Slot | torch.Tensor) -> torch.Tensor:
        """A backward unpacks what ``frame`` saved: the slot's tensor, dropped at once unless the weight pass
        unpacks it again and the budget lets it wait."""
        if isinstance(packed, torch.Tensor):
            return packed  # a weight
        with self.lock:
            self.drain()
            phase = self._current.unpack_phase()
            value = frame.value_of(packed, phase)
            packed.later = phase == "input" and self._current.needed_by_weight_pass()
            if not packed.later:
                frame.drop(packed)
            elif not self.may_keep(frame.transient_bytes()):
                # over the budget: the weight pass recomputes it (the slot stays flagged as wanted)
                self.dropped_for_budget(frame.layer, frame.drop(packed, wanted=True))
            return value

    def _released(self, frame: RecomputeFrame, key: int) -> None:
        """A slot autograd released held storage ``key``: uncounted at the next drain (this may run on
        autograd's thread, so it only queues)."""
        self.dead.append((frame, key))

    def recomputed(self, layer: int, seconds: float, repeat: bool) -> None:
        """A call of ``layer`` was recomputed (``repeat``: it had been recomputed before)."""
        self.recompute_s += seconds
        if repeat:
            self.repeat_recomputes += 1
        self.on_recompute(layer, seconds)

    @property
    def idle(self) -> bool:
        """No recomputed call is alive or waiting to be released."""
        return not (self._frames or self.dead)

    def drain(self) -> None:
        """Uncount the tensors of slots autograd released while they held one."""
        with self.lock:
            while self.dead:
                frame, key = self.dead.popleft()
                frame.release(key)

    def retire(self, mb: int | None = None) -> None:
        """The backward of ``mb`` (None: of every micro-batch) is over: its calls drop what they hold, their
        inputs included, and are forgotten (autograd may keep their slots alive in a graph that outlives the
        backward, see :mod:`.swap`)."""
        with self.lock:
            self.drain()
            for key in [mb] if mb is not None else list(self._frames):
                for frame in self._frames_of(key):
                    frame.retire()
                self._frames.pop(key, None)

    def _frames_of(self, mb: int) -> list[RecomputeFrame]:
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
