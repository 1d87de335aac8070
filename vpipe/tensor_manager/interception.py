"""Interception: each managed layer call and each tensor it saves, handed to keep, swap or recompute.

Every managed layer has a forward pre-hook and an always-called forward hook
(:mod:`.layers`). Inside a micro-batch's forward they bracket the layer's forward with
:class:`torch.autograd.graph.saved_tensors_hooks`, so each tensor autograd saves is
attributed to (layer, micro-batch) and kept (D) or swapped (S) by the swap engine; a layer
under R runs through :meth:`Interceptor.forward_layer`, which replaces what it saves by
recompute slots (:mod:`.recompute_store`).

A layer whose policy is D needs none of this once its saved bytes are known: with the
manager's ``metering`` off, every layer kept and the budget, if any, comfortably met, a
kept layer's call runs without saved-tensor hooks (autograd keeps its tensors as it would
without vpipe) and the ledger counts the bytes its last metered call added, until that
micro-batch's backward ends. A storage two layers of a micro-batch save (one layer's
output that the next saves as its input) counts once, with the layer that saved it first,
as a metered call counts it; one that micro-batches share (a constant) counts with each,
never less than a metered call counts. A call whose input shapes differ from the metered
one's is metered again.
Without a budget there is nothing to check per call: the layers' hooks come off
altogether (the manager's ``metering`` setter), and each micro-batch is counted at the
end of its forward.

Forwards outside ``micro_batch()`` (torch pipelining's shape inference, evaluation) and
forwards run inside a backward (recomputes) pass through untouched and uncounted.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vpipe.compat.torch_internals import current_graph_task_id
from vpipe.plan import Policy
from vpipe.tensor_manager.accounting import RecomputeCounter
from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.handles import KeptHandle, ShardHandle, without_graph
from vpipe.tensor_manager.layers import KeptCall, LayerCall, ManagedLayer, input_shapes
from vpipe.tensor_manager.phases import BackwardPhases
from vpipe.tensor_manager.prefetch import Prefetcher
from vpipe.tensor_manager.stores import SavedTensorStores

__all__ = ["Interceptor"]


class Interceptor:
    """The layer hooks and saved-tensor hooks of one tensor manager.

    ``mb`` is the micro-batch whose forward runs now (None outside ``micro_batch()``), between
    :meth:`begin_micro_batch` and :meth:`end_micro_batch`.
    """

    def __init__(self, *, device: torch.device, min_swap_bytes: int, stores: SavedTensorStores,
                 budget: BudgetGovernor, phases: BackwardPhases, prefetcher: Prefetcher) -> None:
        self.device_index = -1 if device.type == "cpu" else device.index  # what Tensor.get_device() says
        self.min_swap_bytes = min_swap_bytes
        self._stores = stores
        self.ledger = stores.ledger
        self._engine = stores.engine
        self._recompute = stores.recompute
        self._budget = budget
        self._phases = phases
        self._prefetcher = prefetcher
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._save_inputs = (self.pack, self.unpack)  # what a recomputed call's inputs are saved through
        self._tls = threading.local()
        self.mb: int | None = None
        self._unmetered = False  # kept layers of this micro-batch skip the saved-tensor hooks
        # swapped layers whose tensors stay on the device in this micro-batch (what would come straight back,
        # what the budget has room for; governor.swaps_to_skip)
        self._held_back: frozenset[int] = frozenset()
        # whether recomputed calls measure what they would save (off: as their last metered call of the same
        # input shapes; the manager follows its own ``metering``)
        self._metering = True
        self.counted: dict[int, list[tuple[int, int]]] = {}  # mb -> (layer, bytes) of its unmetered calls
        self.weights_skipped = 0
        self.dtensors_swapped = 0

    # ================================================================== told by the manager
    def begin_micro_batch(self, mb: int, unmetered: bool, held_back: frozenset[int]) -> None:
        """``mb``'s forward runs from now: with ``unmetered`` its kept layers of the measured shapes skip the
        saved-tensor hooks; the swapped layers in ``held_back`` keep their tensors in it."""
        self.mb, self._unmetered, self._held_back = mb, unmetered, held_back

    def end_micro_batch(self) -> None:
        self.mb = None

    @property
    def forwarding(self) -> bool:
        """Whether a micro-batch's forward runs now."""
        return self.mb is not None

    def meter_recomputes(self, on: bool) -> None:
        """Whether recomputed calls measure what they would save (off: counted as
        their last metered call of the same input shapes)."""
        self._metering = on

    def swap_from(self, min_swap_bytes: int) -> None:
        """Tensors smaller than ``min_swap_bytes`` are kept whatever the policy."""
        self.min_swap_bytes = min_swap_bytes

    @property
    def holds_nothing(self) -> bool:
        """Nothing saved through the hooks is alive, waiting to be released, or being copied."""
        return self._stores.idle

    # ================================================================== layer calls
    def _frames(self) -> list[LayerCall | KeptCall | None]:
        frames = getattr(self._tls, "frames", None)
        if frames is None:
            frames = self._tls.frames = []
        return frames

    def pre_forward(self, layer: ManagedLayer, module: nn.Module, args: tuple[Any, ...]) -> None:
        frames = self._frames()
        if (self.mb is None or self._phases.running or not torch.is_grad_enabled()
                or current_graph_task_id() != -1):
            frames.append(None)  # not a managed forward: shape inference, eval, recompute
            return
        if self._unmetered and layer.policy is Policy.KEEP and layer.input_shapes == input_shapes(args):
            frames.append(KeptCall(layer, self.mb))
            return
        frame = LayerCall(layer, self.mb, args, self._engine.entries_made + 1)
        if frame.policy is Policy.SWAP and layer.layer_id in self._held_back:
            frame.policy = Policy.KEEP  # what this call would swap out would come straight back
        frames.append(frame)
        self.hooks.__enter__()

    def post_forward(self, layer: ManagedLayer, module: nn.Module, args: tuple[Any, ...],
                     output: Any) -> None:
        frame = self._frames().pop()
        if frame is None:
            return
        elapsed = time.perf_counter() - frame.t0
        layer.forward_s = elapsed if layer.forward_s is None else 0.8 * layer.forward_s + 0.2 * elapsed
        if isinstance(frame, KeptCall):
            nbytes = layer.kept_bytes or 0
            self.ledger.add(layer.layer_id, frame.mb, nbytes)
            self.counted.setdefault(frame.mb, []).append((layer.layer_id, nbytes))
            return
        self.hooks.__exit__(None, None, None)
        if frame.policy is Policy.KEEP:  # what an unmetered call of the same shapes will be counted with
            layer.kept_bytes, layer.input_shapes = frame.new_bytes, input_shapes(frame.inputs)
        if frame.policy is Policy.RECOMPUTE:
            counter, frame.counter = frame.counter, None  # it holds frame.is_weight: no cycle left behind
            if counter is not None:
                activation, swappable = counter.bytes, counter.swappable
                layer.recompute_bytes = (input_shapes(frame.inputs), activation, swappable)
            # an unmetered call: as the last metered one of its shapes
            elif layer.recompute_bytes is not None:
                _, activation, swappable = layer.recompute_bytes
            else:
                activation = swappable = 0
            self.ledger.inputs[layer.layer_id] = frame.bytes  # what checkpoint kept: the inputs
        else:
            activation, swappable = frame.bytes, frame.swappable
            # what a recompute would keep instead: the layer's tensor inputs
            self.ledger.inputs[layer.layer_id] = frame.input_bytes()
        self.ledger.record_activation(layer.layer_id, frame.mb, activation, swappable)
        self._budget.note_activation(activation)
        self._engine.flush_swap_outs()  # the layer's swap-outs, as one batch of copies
        if self._engine.copies_in_flight:
            self._engine.poll()
        self._budget.check_fits(layer.layer_id, activation)

    def forward_layer(self, layer: ManagedLayer, inner: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """The forward attribute of a layer under R: recompute slots when managed, else the original."""
        frames = self._frames()
        frame = frames[-1] if frames else None
        # a KeptCall frame is a kept layer's unmetered call: nothing to recompute either
        if not isinstance(frame,
                          LayerCall) or frame.layer is not layer or frame.policy is not Policy.RECOMPUTE:
            return inner(*args, **kwargs)
        measured = layer.recompute_bytes
        if self._metering or measured is None or measured[0] != input_shapes(frame.inputs):
            frame.counter = RecomputeCounter(frame.is_weight, self.min_swap_bytes)
        layer.recompute_calls += 1
        return self._recompute.run(layer.module, inner, args, kwargs, layer=layer.layer_id, mb=frame.mb,
                                   counter=frame.counter, is_weight=frame.is_weight,
                                   save_inputs=self._save_inputs)

    # ================================================================== unmetered calls
    def uncount(self, mb: int) -> None:
        """The backward of ``mb`` ended: the bytes its unmetered calls were counted with are gone."""
        counts = self.counted.pop(mb, None)
        if counts:
            self.ledger.sub_micro_batch(mb, counts)

    def uncount_all(self) -> None:
        """No micro-batch is counted any more (a step ended, or its backwards will not be seen)."""
        for mb in list(self.counted):
            self.uncount(mb)

    def count_unhooked(self, mb: int, counts: list[tuple[int, int]]) -> None:
        """A micro-batch ran with the layers' hooks off: count each ``(layer, bytes)`` its layers measured."""
        self.ledger.add_micro_batch(mb, counts)
        counted = self.counted.get(mb)
        if counted is None:
            self.counted[mb] = list(counts)  # (the manager hands every such micro-batch the same list)
        else:
            counted.extend(counts)

    def counted_micro_batches(self, layer_id: int) -> dict[int, int]:
        """Micro-batches counted with bytes of unmetered calls of ``layer_id`` -> 1."""
        return {mb: 1 for mb, calls in self.counted.items() if any(lid == layer_id for lid, _ in calls)}

    # ================================================================== saved tensors
    def pack(self, t: torch.Tensor) -> Any:
        frame: LayerCall = self._tls.frames[-1]
        if frame.is_weight(t):
            self.weights_skipped += 1
            return t
        if (
            type(t) is not torch.Tensor
            or t.get_device() != self.device_index
            or t.layout is not torch.strided
        ):
            if isinstance(t, DTensor):
                return self._pack_shard(t)
            # subclasses, sparse tensors, other devices: autograd keeps them as they are
            return without_graph(t)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return without_graph(t)
        key = storage.data_ptr()
        engine = self._engine
        if engine.dead:
            engine.drain()
        layer_id = frame.layer.layer_id
        budget = self._budget
        budgeted = budget.budget_bytes is not None
        swap = frame.policy is Policy.SWAP and nbytes >= self.min_swap_bytes
        if not swap and budgeted and nbytes >= self.min_swap_bytes and budget.forces_swap(key, nbytes):
            swap = True
        if swap:
            # (t itself, graph and all: only its copy out reads it, and the entry lets go once the copy ran)
            handle = engine.swap_out(t, storage, layer_id, frame.mb, key, nbytes)
            limit = budget.limit() if budgeted else None
            if limit is not None and self.ledger.resident > limit:
                # the swapped bytes are still here until their copy ran: issue it and wait for it
                engine.wait_swap_outs(limit)
        else:
            # (the handle holds it without its graph)
            handle = engine.keep(t, layer_id, frame.mb, key, nbytes)
        entry = handle.entry
        if entry not in frame.entries:  # count each storage once per layer call
            frame.entries.add(entry)
            frame.bytes += nbytes
            if entry.seq >= frame.first_seq or entry.mb != frame.mb:  # not a storage an earlier layer of the
                frame.new_bytes += nbytes                               # same micro-batch saved (its output)
            if nbytes >= self.min_swap_bytes:
                frame.swappable += nbytes
        return handle

    def _pack_shard(self, t: DTensor) -> Any:
        """A DTensor is saved as its local shard (kept or swapped
        like any tensor) and wrapped again on unpack."""
        with torch.no_grad():
            local = t.to_local()
        inner = self.pack(local)
        if isinstance(inner, torch.Tensor):
            return without_graph(t)
        if inner.__class__ is not KeptHandle:
            self.dtensors_swapped += 1
        return ShardHandle(inner, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.__class__ is ShardHandle:
            return packed.wrap(self.unpack(packed.inner))
        if packed.__class__ is KeptHandle:
            self._phases.kept_unpacked(packed.entry)
            if self._prefetcher.throttled:  # the kept tensors this backward used so far may have left room
                self._prefetcher.pump()
            return packed.tensor
        tensor = self._phases.restore(packed)
        if self._prefetcher.throttled:
            self._prefetcher.pump()
        return tensor
