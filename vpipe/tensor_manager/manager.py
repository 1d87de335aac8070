"""The tensor manager of one stage: keep (D), swap (S) or recompute (R) each layer's saved tensors.

How it attaches (nothing is replaced: ``close()`` restores the modules exactly, see
:mod:`.layers`):

* every managed layer (a child of the stage's ``nn.Sequential``, keyed by its global layer
  id) gets a forward pre-hook and an always-called forward hook. Inside a micro-batch's
  forward they bracket the layer's forward with :class:`torch.autograd.graph.saved_tensors_hooks`,
  so each tensor autograd saves is attributed to (layer, micro-batch);
* a layer whose policy is R also carries an instance attribute ``forward`` that runs the
  original forward with what it saves replaced by recompute slots (:mod:`.recompute`); it
  is set when the policy becomes R and deleted when it stops being R or the manager closes.

Backward passes are bracketed by :meth:`TensorManager.backward` with a phase: ``"full"``,
or, for the zero-bubble schedules that split a backward, ``"input"`` (input gradients,
``retain_graph``) and later ``"weight"`` (weight gradients). In the input pass every unpack
of a swapped or recomputed tensor asks autograd whether the node unpacking it runs again
in the weight pass (:meth:`TensorManager._needed_by_weight_pass`); those tensors stay on
the device until the weight pass used them, so each is fetched once and each layer call
recomputed once, and the bytes they hold count as resident. A micro-batch between its two
passes is *lagging*; the budget projection counts what lagging micro-batches hold (see
:mod:`.budget`), and if keeping them would pass the budget at the end of an input pass the
largest are dropped (fetched or recomputed again for the weight pass, counted and logged).

A layer whose policy is D needs none of this once its saved bytes are known: with
``metering`` off (``vpipe.attach`` turns it off on the steps its monitor does not sample),
every layer kept and the budget, if any, comfortably met, a kept layer's call runs without
saved-tensor hooks (autograd keeps its tensors as it would without vpipe) and the ledger
counts the bytes its last metered call saved, until that micro-batch's backward ends. A
call whose input shapes differ from the metered one's is metered again.

Forwards outside ``micro_batch()`` (torch pipelining's shape inference, evaluation) and
forwards run inside a backward (recomputes) pass through untouched and uncounted. The
policy is read when the layer is called, so a plan may change it between micro-batches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from vpipe.log import decision
from vpipe.plan import Plan, Policy
from vpipe.tensor_manager.accounting import Ledger, format_bytes
from vpipe.tensor_manager.budget import LayerEstimate, check_layer_fits, fit_micro_batch
from vpipe.tensor_manager.copy_engine import D2H, H2D, make_copy_engine
from vpipe.tensor_manager.pool import DEFAULT_CHUNK_BYTES, HostPool, default_host_pool_bytes
from vpipe.tensor_manager.prefetch import BACKWARD, FORWARD, ArrivalPredictor
from vpipe.tensor_manager.layers import LayerCall, ManagedLayer, claim_module, release_module
from vpipe.tensor_manager.recompute import RecomputeCounter, RecomputeStore
from vpipe.tensor_manager.stats import LayerStats, TensorManagerStats
from vpipe.tensor_manager.swap import KeptHandle, SwapEngine

log = logging.getLogger("vpipe.tensor_manager")

__all__ = ["TensorManager", "LayerBusyError", "DEFAULT_MIN_SWAP_BYTES"]

# Below this a device->host copy is latency-bound and the bookkeeping costs more than it saves.
DEFAULT_MIN_SWAP_BYTES = 64 * 1024
# Copy bandwidth assumed before the first copy was timed (bytes/s).
_ASSUMED_BANDWIDTH = {"cpu": 4e9, "cuda": 12e9}
# How many forward-times of compute a swap can hide behind when copies are asynchronous.
_SWAP_OVERLAP = {"cpu": 0.0, "cuda": 3.0}
# Under a budget, kept layers run without hooks only while a micro-batch's projected bytes stay this far
# below the room left: the counted bytes are the last metered call's, so leave room for them to be off.
_UNMETERED_HEADROOM = 0.9


class _KeptCall:
    """A kept layer's call that runs without saved-tensor hooks (see the module docstring)."""

    __slots__ = ("layer", "mb", "t0")

    def __init__(self, layer: ManagedLayer, mb: int) -> None:
        self.layer = layer
        self.mb = mb
        self.t0 = time.perf_counter()


def _input_shapes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.shape for a in args if isinstance(a, torch.Tensor))


class LayerBusyError(RuntimeError):
    """A layer cannot be removed while saved tensors of its forwards are alive."""


class TensorManager:
    """Per-stage manager of saved activations (see the module docstring and docs/tensor-manager.md)."""

    def __init__(
        self,
        layers: Mapping[int, nn.Module],
        *,
        device: torch.device | str,
        budget_bytes: int | None = None,
        host_pool_bytes: int | None = None,
        min_swap_bytes: int = DEFAULT_MIN_SWAP_BYTES,
        policies: Mapping[int, Policy | str] | None = None,
        host_pool_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
            raise ValueError(f"budget_bytes must be a positive integer or None, got {budget_bytes!r}")
        if host_pool_bytes is not None and (not isinstance(host_pool_bytes, int) or host_pool_bytes <= 0):
            raise ValueError(f"host_pool_bytes must be a positive integer or None, got {host_pool_bytes!r}")
        if not isinstance(min_swap_bytes, int) or min_swap_bytes < 0:
            raise ValueError(f"min_swap_bytes must be a non-negative integer, got {min_swap_bytes!r}")
        self.device = device
        self._device_index = -1 if device.type == "cpu" else device.index  # what Tensor.get_device() says
        self.budget_bytes = budget_bytes
        self.min_swap_bytes = min_swap_bytes
        self.host_pool_max_bytes = host_pool_bytes or default_host_pool_bytes()
        self.ledger = Ledger()
        self._copies = make_copy_engine(device)
        self._engine = SwapEngine(device, self.ledger, self._copies, partial(
            HostPool, self.host_pool_max_bytes, pinned=self._copies.pinned, chunk_bytes=host_pool_chunk_bytes,
            preallocate=True))
        self._predictor = ArrivalPredictor()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._tls = threading.local()
        self._layers: dict[int, ManagedLayer] = {}
        self._mb: int | None = None
        self._backward: list[tuple[int, str]] = []  # (micro-batch, phase) of the backwards running now
        self._phase_serial = 0  # numbers the backward() contexts (a storage unpacked in two is multi-phase)
        self._phase_unpacked = False  # the running phase unpacked a swapped or recomputed tensor
        self._open: set[int] = set()  # forwarded, backward not finished
        self._open_max = 0
        self._open_max_last_step = 0
        self._split = False  # an input phase was seen: this stage's backwards are split (zero bubble)
        self._lagging: set[int] = set()  # input pass done, weight pass not yet
        self._lag_max = 0
        self._lag_max_last_step = 0
        self._lag_kept: set[Any] = set()  # under a budget: kept storages an input pass flagged for its weight pass
        self._recompute = RecomputeStore(device, self.ledger, self._engine.lock, phase=self._unpack_phase,
                                         needed_later=self._needed_by_weight_pass, may_keep=self._may_keep,
                                         on_recompute=self._recomputed)
        self._repeat_recomputes = 0
        # largest activation of one layer and micro-batch seen: what a backward brings back or recomputes at
        # once; a stage that keeps everything, and fits so, brings nothing back and needs none (_budget_limit)
        self._reserve = 0
        self._prefetch_throttled = False
        self._recompute_s = 0.0
        self._budget_swaps = 0
        self._weights_skipped = 0
        self._escalations: list[tuple[int, Policy, Policy]] = []
        # every call goes through the saved-tensor hooks while True; vpipe.attach lowers it on unsampled steps
        self.metering = True
        self._all_keep = True
        self._unmetered = False  # whether kept layers skip the hooks in the current micro-batch
        self._counted: dict[int, list[tuple[int, int]]] = {}  # mb -> (layer, bytes) of its unmetered calls
        self._kept_per_mb: int | None = None  # resident bytes a metered micro-batch added, every layer kept
        self._keep_all_fits = False  # under a budget: the last projection found that keeping everything fits
        self._closed = False
        for layer_id, module in layers.items():
            self.add_layer(layer_id, module)
        if policies:
            self.set_policies(policies)

    # ================================================================== layers
    def add_layer(self, layer_id: int, module: nn.Module, policy: Policy | str = Policy.KEEP) -> None:
        """Manage one more layer (e.g. one that migrated to this stage)."""
        self._check_open()
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) or layer_id < 0:
            raise ValueError(f"layer id must be a non-negative integer, got {layer_id!r}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"layer {layer_id} must be an nn.Module, got {type(module).__name__}")
        if layer_id in self._layers:
            raise ValueError(f"layer {layer_id} is already managed by this tensor manager")
        claim_module(module, self, layer_id)
        layer = ManagedLayer(layer_id, module)
        layer.attach(partial(self._pre_forward, layer), partial(self._post_forward, layer))
        self._layers[layer_id] = layer
        self.set_policy(layer_id, policy)

    def remove_layer(self, layer_id: int) -> nn.Module:
        """Stop managing a layer (it migrates away); its saved tensors must all be gone."""
        layer = self._layer(layer_id)
        live = self._engine.live_micro_batches(layer_id)
        live.update({mb: 1 for mb, calls in self._counted.items() if any(lid == layer_id for lid, _ in calls)})
        if live:
            resident = sum(self.ledger.resident_of(layer_id).values())
            raise LayerBusyError(
                f"layer {layer_id} still has saved activations of micro-batches {sorted(live)} "
                f"({format_bytes(resident)} on the device); run their backward before removing the layer"
            )
        self._detach(layer)
        del self._layers[layer_id]
        self._all_keep = all(other.policy is Policy.KEEP for other in self._layers.values())
        self.ledger.forget_layer(layer_id)
        self._reserve = max((self.ledger.activation_bytes(lid) or 0 for lid in self._layers), default=0)
        return layer.module

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self._layers)

    def _layer(self, layer_id: int) -> ManagedLayer:
        try:
            return self._layers[layer_id]
        except KeyError:
            raise KeyError(f"layer {layer_id} is not managed by this tensor manager "
                           f"(it manages layers {self.layer_ids})") from None

    def _detach(self, layer: ManagedLayer) -> None:
        try:
            layer.detach()
        finally:
            release_module(layer.module)

    # ================================================================== policies
    def policy(self, layer_id: int) -> Policy:
        return self._layer(layer_id).policy

    def policies(self) -> dict[int, Policy]:
        return {lid: layer.policy for lid, layer in sorted(self._layers.items())}

    def set_policy(self, layer_id: int, policy: Policy | str) -> None:
        """Takes effect at the layer's next call (the next micro-batch)."""
        self._check_open()
        layer = self._layer(layer_id)
        policy = policy if isinstance(policy, Policy) else Policy.parse(policy)
        layer.policy = policy
        self._all_keep = all(other.policy is Policy.KEEP for other in self._layers.values())
        if policy is Policy.RECOMPUTE:
            layer.route_forward(self._forward_layer)
        else:
            layer.restore_forward()
        if policy is Policy.SWAP:
            _ = self._engine.pool  # pin the first chunk now, not in the middle of a forward

    def set_policies(self, policies: Mapping[int, Policy | str]) -> None:
        unknown = sorted(set(policies) - set(self._layers))
        if unknown:
            raise KeyError(f"policies name layers {unknown} that this tensor manager does not manage "
                           f"(it manages layers {self.layer_ids})")
        for layer_id, policy in policies.items():
            self.set_policy(layer_id, policy)

    def apply_plan(self, plan: Plan) -> None:
        """Set this stage's policies from a plan (layers it does not list are kept, D)."""
        self.set_policies({lid: plan.policy(lid) for lid in self._layers})

    # ================================================================== contexts
    @contextmanager
    def micro_batch(self, mb_id: int) -> Iterator[TensorManager]:
        """Around one micro-batch's forward: its saved tensors are managed and attributed to ``mb_id``."""
        self._check_open()
        if self._mb is not None:
            raise RuntimeError(f"micro-batch {mb_id}'s forward started inside micro-batch {self._mb}'s forward")
        self._begin_forward(mb_id)
        self._mb = mb_id
        start, swaps = self.ledger.resident, self._budget_swaps
        measured = torch.is_grad_enabled() and not self._unmetered and self._all_keep
        try:
            yield self
        finally:
            self._mb = None
            self._engine.flush_swap_outs()
            self._engine.poll()
            if measured and self._budget_swaps == swaps:
                # what one micro-batch keeps, each storage once: the schedule's own footprint per micro-batch
                self._kept_per_mb = self.ledger.resident - start

    @contextmanager
    def backward(self, mb_id: int, phase: str = "full") -> Iterator[TensorManager]:
        """Around one backward phase of a micro-batch: prefetch ordering and release bookkeeping.

        ``phase`` is ``"full"``, or ``"input"`` then ``"weight"`` for schedules that split the
        backward (zero bubble): what the input pass brings back or recomputes and the weight
        pass needs stays on the device between the two (counted as resident), everything else
        goes after the input pass; the micro-batch holds its bytes until its weight pass ends.
        """
        if phase not in ("full", "input", "weight"):
            raise ValueError(f"backward phase must be 'full', 'input' or 'weight', got {phase!r}")
        self._predictor.observe(BACKWARD, mb_id)
        if phase == "input":
            self._split = True
            self._lagging.discard(mb_id)  # a new input pass (a retried step): not lagging until it ends
        self._phase_serial += 1
        self._backward.append((mb_id, phase))
        self._phase_unpacked = False
        dropped = self._lag_dropped_bytes()
        try:
            self._pump_prefetch()
            yield self
        finally:
            self._backward.pop()
            self._end_phase(mb_id, phase, dropped)
            self._engine.poll()
            if phase != "input":
                self._open.discard(mb_id)
                self._uncount(mb_id)

    def _lag_dropped_bytes(self) -> tuple[dict[int, int], dict[int, int]]:
        """Per layer, bytes kept for weight passes that were dropped for the budget: (swapped, recomputed)."""
        return dict(self._engine.dropped_bytes), dict(self._recompute.dropped_bytes)

    def _end_phase(self, mb: int, phase: str, dropped_before: tuple[dict[int, int], dict[int, int]]) -> None:
        """Drop what no later pass of ``mb`` needs; after an input pass keep the rest within the budget.

        What the weight pass needs stays on the device unless that passes the budget less the
        backward's reserve: then the largest copies go first (a copy back is cheaper than a
        forward), then recomputed tensors; the weight pass fetches or recomputes them again.
        Each input pass that dropped something logs one ``weight_pass_drop`` decision.
        """
        unpacked = self._phase_unpacked
        held = self._engine.end_phase(mb, phase, unpacked)
        recomputed = self._recompute.end_phase(mb, phase, unpacked)
        if phase != "input":
            self._lagging.discard(mb)
            self._lag_kept.clear()
            return
        self._lagging.add(mb)
        self._lag_max = max(self._lag_max, len(self._lagging))
        # what each layer of this micro-batch holds for its weight pass: the budget's projection uses it
        for entry in self._lag_kept:
            held[entry.layer] = held.get(entry.layer, 0) + entry.nbytes
        self._lag_kept.clear()
        for lid, nbytes in recomputed.items():
            held[lid] = held.get(lid, 0) + nbytes
        # what the budget dropped during the pass was needed too: the projection must count it
        for now, before in zip(self._lag_dropped_bytes(), dropped_before):
            for lid, nbytes in now.items():
                if nbytes > before.get(lid, 0):
                    held[lid] = held.get(lid, 0) + nbytes - before.get(lid, 0)
        measured = self.budget_bytes is not None  # kept layers were measured too (_lag_kept)
        for lid, layer in self._layers.items():
            if lid in held or measured or layer.policy is not Policy.KEEP:
                self.ledger.lag[lid] = held.get(lid, 0)
        limit = self._budget_limit()
        if limit is not None and self.ledger.resident > limit:
            excess = self.ledger.resident - limit
            freed = self._engine.drop_held(mb, excess)
            if freed < excess:
                self._recompute.drop_held(mb, excess - freed)
        swapped, recomputed_bytes = (sum(now.values()) - sum(before.values())
                                     for now, before in zip(self._lag_dropped_bytes(), dropped_before))
        if swapped or recomputed_bytes:
            decision(
                "weight_pass_drop",
                f"micro-batch {mb}: dropped {format_bytes(swapped + recomputed_bytes)} its weight pass needs to stay "
                f"under the budget ({format_bytes(swapped)} to fetch again, {format_bytes(recomputed_bytes)} to "
                f"recompute again)", micro_batch=mb, swapped_bytes=swapped, recomputed_bytes=recomputed_bytes,
                budget_bytes=self.budget_bytes, lagging=len(self._lagging),
            )

    def _fetch_phase(self, mb: int) -> str:
        """The backward phase a fetch for ``mb`` now serves."""
        if self._backward and self._backward[-1][0] == mb:
            return self._backward[-1][1]
        if mb in self._lagging:
            return "weight"
        return "input" if self._split else "full"

    def prefetch(self, mb_id: int) -> bool:
        """Start bringing ``mb_id``'s swapped tensors back now; False if the budget held some back."""
        return self._engine.prefetch(mb_id, self._prefetch_limit(), self._fetch_phase(mb_id))

    def _begin_forward(self, mb: int) -> None:
        engine = self._engine
        engine.drain()
        self._recompute.drain()
        engine.poll()
        if self._predictor.observe(FORWARD, mb):  # a new step: remember how many were in flight in the last
            self._open_max_last_step, self._open_max = self._open_max, 0
            self._lag_max_last_step, self._lag_max = self._lag_max, len(self._lagging)
        self._unmetered = False
        if not torch.is_grad_enabled():
            return  # an evaluation forward saves nothing and has no backward
        self._uncount(mb)  # a micro-batch of a step that failed before its backward
        self._open.add(mb)
        self._open_max = max(self._open_max, len(self._open))
        if self.budget_bytes is not None:
            self._fit_budget(mb)
        self._unmetered = not self.metering and self._all_keep and self._comfortably_within_budget()
        self._pump_prefetch()

    def _comfortably_within_budget(self) -> bool:
        """Whether the next micro-batch, every layer kept, fits with room to spare (always, without a budget)."""
        if self.budget_bytes is None:
            return True
        if not self._keep_all_fits:
            return False
        per_mb = 0
        for layer in self._layers.values():
            if layer.kept_bytes is None:
                return False
            per_mb += layer.kept_bytes
        usable = self.budget_bytes  # every layer kept: no backward reserve
        in_flight = max(self._open_max_last_step, len(self._open), 1)
        room = min(usable - self.ledger.resident, usable // in_flight)
        return per_mb <= _UNMETERED_HEADROOM * room

    def end_of_step(self) -> None:
        """Every micro-batch's backward has run (a hand-written loop's ``optimizer.step()``): none is counted."""
        for mb in list(self._counted):
            self._uncount(mb)

    def _uncount(self, mb: int) -> None:
        """The backward of ``mb`` ended: the bytes its unmetered calls were counted with are gone."""
        for layer_id, nbytes in self._counted.pop(mb, ()):
            self.ledger.sub(layer_id, mb, nbytes)

    # ================================================================== hooks
    def _frames(self) -> list[LayerCall | None]:
        frames = getattr(self._tls, "frames", None)
        if frames is None:
            frames = self._tls.frames = []
        return frames

    def _pre_forward(self, layer: ManagedLayer, module: nn.Module, args: tuple[Any, ...]) -> None:
        frames = self._frames()
        if (self._mb is None or self._backward or not torch.is_grad_enabled()
                or torch._C._current_graph_task_id() != -1):
            frames.append(None)  # not a managed forward: shape inference, eval, recompute
            return
        if self._unmetered and layer.policy is Policy.KEEP and layer.input_shapes == _input_shapes(args):
            frames.append(_KeptCall(layer, self._mb))
            return
        frames.append(LayerCall(layer, self._mb, args))
        self._hooks.__enter__()

    def _post_forward(self, layer: ManagedLayer, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        frame = self._frames().pop()
        if frame is None:
            return
        elapsed = time.perf_counter() - frame.t0
        layer.forward_s = elapsed if layer.forward_s is None else 0.8 * layer.forward_s + 0.2 * elapsed
        if frame.__class__ is _KeptCall:
            nbytes = layer.kept_bytes or 0
            self.ledger.add(layer.layer_id, frame.mb, nbytes)
            self._counted.setdefault(frame.mb, []).append((layer.layer_id, nbytes))
            return
        self._hooks.__exit__(None, None, None)
        if frame.policy is Policy.KEEP:  # what an unmetered call of the same shapes will be counted with
            layer.kept_bytes, layer.input_shapes = frame.bytes, _input_shapes(frame.inputs)
        if frame.policy is Policy.RECOMPUTE:
            counter, frame.counter = frame.counter, None  # it holds frame.is_weight: no cycle left behind
            activation = counter.bytes if counter is not None else 0
            swappable = counter.swappable if counter is not None else 0
            self.ledger.inputs[layer.layer_id] = frame.bytes  # what checkpoint kept: the inputs
        else:
            activation, swappable = frame.bytes, frame.swappable
            # what a recompute would keep instead: the layer's tensor inputs
            self.ledger.inputs[layer.layer_id] = frame.input_bytes()
        self.ledger.record_activation(layer.layer_id, frame.mb, activation, swappable)
        if activation > self._reserve:
            self._reserve = activation
        self._engine.flush_swap_outs()  # the layer's swap-outs, as one batch of copies
        if self._engine.copies_in_flight:
            self._engine.poll()
        if self.budget_bytes is not None:
            check_layer_fits(layer.layer_id, activation, self.budget_bytes)

    def _forward_layer(self, layer: ManagedLayer, inner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The forward attribute of a layer under R: checkpoint when managed, else the original."""
        frames = self._frames()
        frame = frames[-1] if frames else None
        if frame is None or frame.layer is not layer or frame.policy is not Policy.RECOMPUTE:
            return inner(*args, **kwargs)
        frame.counter = RecomputeCounter(frame.is_weight, self.min_swap_bytes)
        layer.recompute_calls += 1
        return self._recompute.run(layer.module, inner, args, kwargs, layer=layer.layer_id, mb=frame.mb,
                                   counter=frame.counter, is_weight=frame.is_weight)

    def _recomputed(self, layer_id: int, seconds: float, repeat: bool) -> None:
        with self._engine.lock:
            layer = self._layers.get(layer_id)
            if layer is not None:  # (a layer removed since holds no saved tensors: never recomputed)
                layer.recompute_s += seconds
                layer.recomputes += 1
            self._recompute_s += seconds
            if repeat:
                self._repeat_recomputes += 1

    def _pack(self, t: torch.Tensor) -> Any:
        frame: LayerCall = self._tls.frames[-1]
        if frame.is_weight(t):
            self._weights_skipped += 1
            return t
        if t.grad_fn is not None:
            # a saved output's grad_fn is the node saving it: holding the tensor itself would make
            # a reference cycle (node -> saved handle -> tensor -> node) that only the GC breaks
            t = t.detach()
        if type(t) is not torch.Tensor or t.get_device() != self._device_index or t.layout is not torch.strided:
            return t  # subclasses, sparse tensors, other devices: autograd keeps them as they are
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return t
        key = storage.data_ptr()
        engine = self._engine
        if engine.dead:
            engine.drain()
        layer_id = frame.layer.layer_id
        swap = frame.policy is Policy.SWAP and nbytes >= self.min_swap_bytes
        if (not swap and self.budget_bytes is not None and nbytes >= self.min_swap_bytes
                and self._over_budget(key, nbytes)):
            swap = True
            self._budget_swaps += 1
        if swap:
            handle = engine.swap_out(t, storage, layer_id, frame.mb, key, nbytes)
            limit = self._budget_limit()
            if limit is not None and self.ledger.resident > limit:
                # the swapped bytes are still here until their copy ran: issue it and wait for it
                engine.wait_swap_outs(limit)
        else:
            handle = engine.keep(t, layer_id, frame.mb, key, nbytes)
        if handle.entry not in frame.entries:  # count each storage once per layer call
            frame.entries.add(handle.entry)
            frame.bytes += nbytes
            if nbytes >= self.min_swap_bytes:
                frame.swappable += nbytes
        return handle

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.__class__ is KeptHandle:
            if self._lag_measured() and self._needed_by_weight_pass():
                self._lag_kept.add(packed.entry)
            return packed.tensor
        phase = self._unpack_phase()
        later = phase == "input" and self._needed_by_weight_pass()
        tensor = self._engine.restore(packed, phase, self._phase_serial, later, self._budget_limit())
        if self._prefetch_throttled:
            self._pump_prefetch()
        return tensor

    def _unpack_phase(self) -> str:
        """The phase of the backward unpacking now (``"full"`` outside any ``backward()``); marks it as used."""
        self._phase_unpacked = True
        return self._backward[-1][1] if self._backward else "full"

    def _may_keep(self, transient_bytes: int) -> bool:
        """Whether a recomputed tensor may stay for the weight pass: the resident total, less the
        recompute's tensors about to go, stays within the budget less the backward's reserve."""
        limit = self._budget_limit()
        return limit is None or self.ledger.resident - transient_bytes <= limit

    def _lag_measured(self) -> bool:
        """Under a budget, an input pass also learns what kept layers' weight passes need (for the projection)."""
        return self.budget_bytes is not None and bool(self._backward) and self._backward[-1][1] == "input"

    def _needed_by_weight_pass(self) -> bool:
        """Whether the autograd node unpacking now runs again in the weight pass of a split backward.

        The input pass (``autograd.grad`` towards the stage inputs) runs only nodes on a path
        to an input; the weight pass later starts from the nodes where that part of the graph
        meets the parameters' (torch's ``stage_backward_weight``) and runs those and the
        nodes below them towards the parameters. So a node runs again exactly when one of its
        next functions is a parameter's gradient accumulator or a node this pass does not
        execute (it leads to parameters only). Measured on torch 2.13 for Linear, LayerNorm,
        attention (matmul and SDPA) and weight-normalised matmuls, this matches the unpacks
        of both passes one for one. A node that reaches parameters only through nodes the
        input pass executes too (a weight tied inside the stage) is missed: its tensors are
        fetched or recomputed again, and counted.
        """
        if self._recompute.unpacking_inputs:
            return False  # a recompute reading its inputs, not a backward node
        node = torch._C._current_autograd_node()
        if node is None:
            return False
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:  # a leaf's gradient accumulator
                if isinstance(variable, nn.Parameter):
                    return True
                continue
            try:
                if not torch._C._will_engine_execute_node(child):
                    return True
            except RuntimeError:  # not a node of this pass's graph task: keep rather than fetch twice
                return True
        return False

    # ================================================================== budget
    def _over_budget(self, key: int, nbytes: int) -> bool:
        """Would keeping this storage pass the budget (minus the backward's reserve)? Frees what it can first."""
        engine = self._engine
        existing = engine.lookup(key)
        if existing is not None and not existing.swapped:
            return False  # already resident: keeping it costs nothing more
        limit = self._budget_limit()
        assert limit is not None
        if self.ledger.resident + nbytes <= limit:
            return False
        engine.poll()
        engine.wait_swap_outs(limit - nbytes)
        if self.ledger.resident + nbytes <= limit:
            return False
        return self.host_pool_max_bytes - (engine.pool.used_bytes if engine.has_pool else 0) >= nbytes

    def _estimates(self, lag_share: float = 0.0) -> list[LayerEstimate]:
        out = []
        for lid, layer in sorted(self._layers.items()):
            activation = self.ledger.activation_bytes(lid)
            if activation is None:
                continue  # not measured yet: the per-tensor check at pack time covers it
            check_layer_fits(lid, activation, self.budget_bytes)  # type: ignore[arg-type]
            swappable = min(self.ledger.swappable.get(lid, activation), activation)
            inputs = self.ledger.inputs.get(lid, activation)
            out.append(LayerEstimate(lid, layer.policy, activation, swappable, inputs, layer.forward_s or 0.0,
                                     lag_bytes=self.ledger.lag.get(lid, 0), lag_share=lag_share))
        return out

    def _lag_share(self, in_flight: int) -> float:
        """Micro-batches between their input and weight pass per micro-batch in flight (last step or now)."""
        if not self._split:
            return 0.0
        return min(1.0, max(self._lag_max_last_step, len(self._lagging), 1) / in_flight)

    def _fit_budget(self, mb: int) -> None:
        """Before micro-batch ``mb``'s forward: escalate the cheapest layers until the projection fits."""
        budget = self.budget_bytes
        assert budget is not None
        in_flight = max(self._open_max_last_step, len(self._open), 1)
        estimates = self._estimates(self._lag_share(in_flight))
        # keeping everything needs no backward reserve (nothing is brought back or recomputed): when the
        # measured bytes of a micro-batch, every layer kept, fit that way, as much fits as without vpipe
        kept = self._kept_per_mb
        self._keep_all_fits = (self._all_keep and kept is not None and len(estimates) == len(self._layers)
                               and kept <= min(budget - self.ledger.resident, budget // in_flight))
        if self._keep_all_fits:
            return
        changes = fit_micro_batch(
            estimates, budget_bytes=budget, resident_bytes=self.ledger.resident, reserve_bytes=self._reserve,
            in_flight=in_flight,
            pool_free_bytes=self.host_pool_max_bytes - (self._engine.pool.used_bytes if self._engine.has_pool else 0),
            swap_s_per_byte=1.0 / self._bandwidth(D2H), overlap=_SWAP_OVERLAP[self._kind()],
            context=f"micro-batch {mb}",
        )
        for change in changes:
            self.set_policy(change.layer_id, change.new)
            self._escalations.append((change.layer_id, change.old, change.new))
            decision(
                "policy", f"layer {change.layer_id}: {change.old.value} -> {change.new.value} to fit the budget",
                layer=change.layer_id, old=change.old.value, new=change.new.value, saved_bytes=change.saved_bytes,
                cost_s=change.cost_s, budget_bytes=budget, in_flight=in_flight, micro_batch=mb,
            )

    # ================================================================== prefetch
    def _kind(self) -> str:
        return "cuda" if self.device.type == "cuda" else "cpu"

    def _bandwidth(self, direction: str) -> float:
        return self._copies.bandwidth(direction) or _ASSUMED_BANDWIDTH[self._kind()]

    def _budget_limit(self) -> int | None:
        """What the resident saved bytes may reach: the budget less the backward's reserve."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - (0 if self._keep_all_fits else self._reserve)

    def _prefetch_limit(self) -> int | None:
        return self._budget_limit()

    def _pump_prefetch(self) -> None:
        """Issue the prefetches the schedule's order and the predicted arrival times call for now."""
        engine = self._engine
        if not engine.has_pool:
            return
        bandwidth = self._bandwidth(H2D)
        targets = [mb for mb, _ in self._backward[-1:]] + self._predictor.upcoming(
            lambda mb: engine.host_bytes(mb, mb in self._lagging) / bandwidth)
        limit = self._prefetch_limit()
        throttled = False
        for mb in dict.fromkeys(targets):
            if not engine.prefetch(mb, limit, self._fetch_phase(mb)):
                throttled = True
                break
        self._prefetch_throttled = throttled

    # ================================================================== reporting
    def stats(self) -> TensorManagerStats:
        engine = self._engine
        with engine.lock:
            engine.drain()
            self._recompute.drain()
            engine.poll()
            d2h_bw, h2d_bw = self._bandwidth(D2H), self._bandwidth(H2D)
            layers = {}
            for lid, layer in sorted(self._layers.items()):
                d2h, h2d = engine.layer_d2h.get(lid, 0), engine.layer_h2d.get(lid, 0)
                layers[lid] = LayerStats(
                    layer_id=lid, policy=layer.policy,
                    activation_bytes=dict(self.ledger.activation.get(lid, {})),
                    input_bytes=self.ledger.inputs.get(lid),
                    resident_bytes=sum(self.ledger.resident_of(lid).values()),
                    forward_s=layer.forward_s, recompute_s=layer.recompute_s, recomputes=layer.recomputes,
                    d2h_bytes=d2h, h2d_bytes=h2d, d2h_s=d2h / d2h_bw, h2d_s=h2d / h2d_bw,
                    recompute_calls=layer.recompute_calls, lag_bytes=self.ledger.lag.get(lid),
                )
            pool = engine.pool if engine.has_pool else None
            return TensorManagerStats(
                layers=layers,
                resident_bytes=self.ledger.resident,
                peak_resident_bytes=self.ledger.peak,
                budget_bytes=self.budget_bytes,
                host_pool_used_bytes=pool.used_bytes if pool else 0,
                host_pool_peak_bytes=pool.peak_used_bytes if pool else 0,
                host_pool_capacity_bytes=pool.capacity_bytes if pool else 0,
                host_pool_max_bytes=self.host_pool_max_bytes,
                d2h_bytes=self._copies.bytes[D2H], d2h_s=self._copies.seconds[D2H],
                h2d_bytes=self._copies.bytes[H2D], h2d_s=self._copies.seconds[H2D],
                recompute_s=self._recompute_s,
                sync_fallbacks=engine.sync_fallbacks,
                prefetched=engine.prefetched,
                budget_swaps=self._budget_swaps,
                escalations=tuple(self._escalations),
                live_saved_storages=engine.live_entries(),
                multi_phase_storages=engine.multi_phase_entries,
                weight_tensors_skipped=self._weights_skipped,
                h2d_bytes_by_phase=dict(engine.h2d_by_phase),
                refetched_bytes=engine.refetched_bytes,
                repeat_recomputes=self._repeat_recomputes,
                lag_resident_bytes=sum(engine.held_bytes(mb) + self._recompute.held_bytes(mb) for mb in self._lagging),
                lag_dropped=engine.dropped + self._recompute.dropped,
            )

    def layer_saved_bytes(self) -> dict[int, int]:
        """Per layer, the activation bytes one micro-batch saves (largest seen; 0 if never run)."""
        return {lid: self.ledger.activation_bytes(lid) or 0 for lid in sorted(self._layers)}

    def reset_peak(self) -> None:
        self._engine.drain()
        self._recompute.drain()
        self.ledger.reset_peak()

    def synchronize(self) -> None:
        """Wait for every copy in flight (benchmarks and tests; training never needs it)."""
        self._engine.wait_all()

    # ================================================================== lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this tensor manager is closed")

    def close(self) -> None:
        """Remove every hook and forward attribute; saved tensors still alive stay usable."""
        if self._closed:
            return
        self._closed = True
        for layer in self._layers.values():
            try:
                self._detach(layer)
            except RuntimeError as e:  # someone else's forward attribute: leave it, say so
                log.warning("tensor manager close: %s", e)

    def __enter__(self) -> TensorManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        pol = "".join(layer.policy.value for _, layer in sorted(self._layers.items()))
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return f"TensorManager(device={self.device}, layers={self.layer_ids}, policies={pol}, budget={budget})"
