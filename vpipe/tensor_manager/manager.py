"""The tensor manager of one stage: keep (D), swap (S) or recompute (R) each layer's saved tensors.

:class:`TensorManager` is the facade the runtime, ``vpipe.attach`` and hand-written loops
use: it owns the managed layers and their policies, brackets each micro-batch's forward
and each backward phase, and wires the parts that each do one job:

* :mod:`.interception`: the layer hooks and saved-tensor hooks (which call is managed,
  which tensor is kept or swapped, a layer under R runs through recompute slots);
* :mod:`.swap` / :mod:`.swap_in` and :mod:`.recompute_store`: where saved tensors live;
* :mod:`.phases`: backward phases and split backwards (what waits for a weight pass);
* :mod:`.governor`: the budget's decisions; :mod:`.prefetch`: when to bring tensors back;
* :mod:`.stats`: what it reports.

Nothing is replaced: ``close()`` restores the modules exactly (see :mod:`.layers`). The
policy is read when the layer is called, so a plan may change it between micro-batches.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from vpipe.plan import Plan, Policy
from vpipe.tensor_manager.accounting import Ledger, format_bytes
from vpipe.tensor_manager.copy_engine import D2H, H2D, make_copy_engine
from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.interception import Interceptor
from vpipe.tensor_manager.layers import ManagedLayer, claim_module, input_shapes, release_module
from vpipe.tensor_manager.phases import PHASES, BackwardPhases
from vpipe.tensor_manager.pool import DEFAULT_CHUNK_BYTES, HostPool, default_host_pool_bytes
from vpipe.tensor_manager.prefetch import BACKWARD, FORWARD, Prefetcher
from vpipe.tensor_manager.recompute_store import RecomputeStore
from vpipe.tensor_manager.replay import forget_weight_places
from vpipe.tensor_manager.stats import TensorManagerStats, collect_stats
from vpipe.tensor_manager.swap import SwapEngine
from vpipe.tensor_manager.swap_in import SwapIn

log = logging.getLogger("vpipe.tensor_manager")

__all__ = ["TensorManager", "LayerBusyError", "DEFAULT_MIN_SWAP_BYTES"]

# Below this a device->host copy is latency-bound and the bookkeeping costs more than it saves.
DEFAULT_MIN_SWAP_BYTES = 64 * 1024


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
        pool_max = host_pool_bytes or default_host_pool_bytes()
        self.ledger = Ledger()
        self._layers: dict[int, ManagedLayer] = {}
        self._copies = make_copy_engine(device)
        self._engine = SwapEngine(device, self.ledger, self._copies, partial(
            HostPool, pool_max, pinned=self._copies.pinned, chunk_bytes=host_pool_chunk_bytes, preallocate=True))
        self._swap_in = SwapIn(self._engine)
        self._budget = BudgetGovernor(budget_bytes, pool_max, ledger=self.ledger, engine=self._engine,
                                      layers=self._layers)
        self._phases = BackwardPhases(ledger=self.ledger, swap_in=self._swap_in, budget=self._budget,
                                      layers=self._layers)
        self._recompute = RecomputeStore(device, self.ledger, self._engine.lock, phase=self._phases.unpack_phase,
                                         needed_later=self._phases.needed_by_weight_pass,
                                         may_keep=self._budget.may_keep, on_recompute=self._recomputed)
        self._phases.recompute = self._recompute  # it asks the phases which pass unpacks; they drop what it holds
        self._prefetcher = Prefetcher(self._swap_in, self._phases, self._budget)
        self._interceptor = Interceptor(
            device=device, min_swap_bytes=min_swap_bytes, ledger=self.ledger, engine=self._engine,
            swap_in=self._swap_in, recompute=self._recompute, budget=self._budget, phases=self._phases,
            prefetcher=self._prefetcher)
        self._open: set[int] = set()  # forwarded, backward not finished
        self._open_max = 0
        self._open_max_last_step = 0
        # every call goes through the saved-tensor hooks while True; vpipe.attach lowers it on unsampled steps
        self._metering = True
        self._all_keep = True
        # every layer kept and measured, not metering, and no budget or one that holds a step's micro-batches
        # (as the plain schedule would): no layer hooks at all
        self._hookless = False
        # the tensor input shapes of the last micro-batch run with hooks (None: not known, the caller did not
        # say); under a budget a hookless micro-batch must have these, or it could save more than was measured
        self._input_shapes: tuple[Any, ...] | None = None
        self._counts: list[tuple[int, int]] | None = None  # (layer, bytes) a micro-batch without hooks counts
        self._quiet_ready = False  # hookless, and nothing saved through the hooks alive (see _became_quiet)
        self._closed = False
        for layer_id, module in layers.items():
            self.add_layer(layer_id, module)
        if policies:
            self.set_policies(policies)

    # ================================================================== settings
    @property
    def budget_bytes(self) -> int | None:
        """The device budget for saved activations (None: none); may be changed between micro-batches."""
        return self._budget.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int | None) -> None:
        self._budget.budget_bytes = value
        self._update_hooks()

    @property
    def metering(self) -> bool:
        """Whether every layer call is measured through the hooks (vpipe.attach turns it off on the steps its
        monitor does not sample)."""
        return self._metering

    @metering.setter
    def metering(self, value: bool) -> None:
        if value == self._metering and self._hookless:
            return  # (set at every step: nothing to work out again while the layers run without hooks)
        self._metering = value
        self._interceptor.metering = value
        self._update_hooks()

    @property
    def hooked(self) -> bool:
        """Whether the layers' calls go through vpipe's hooks now (False: they run as without vpipe)."""
        return not self._hookless

    def _update_hooks(self) -> None:
        """With nothing to measure, decide or enforce (every layer kept and measured, metering off, and no budget
        or one that a step's micro-batches fit), the layers' hooks come off: a kept layer then
        costs what it costs without vpipe. A micro-batch is counted with its layers' measured bytes when its
        forward ends; under a budget its inputs must have the shapes of the last measured one."""
        self._counts = None  # (what they are counted with is worked out again at the next such micro-batch)
        self._quiet_ready = False
        budget = self._budget
        hookless = (not self._metering and self._all_keep and bool(self._layers)
                    and all(layer.kept_bytes is not None for layer in self._layers.values())
                    and (budget.budget_bytes is None or (
                        self._input_shapes is not None
                        and budget.holds_unwatched(max(self._open_max_last_step, self._open_max, 1)))))
        if hookless != self._hookless:
            self._hookless = hookless
            for layer in self._layers.values():
                layer.unhook() if hookless else layer.hook()

    @property
    def min_swap_bytes(self) -> int:
        return self._interceptor.min_swap_bytes

    @min_swap_bytes.setter
    def min_swap_bytes(self, value: int) -> None:
        self._interceptor.min_swap_bytes = value

    @property
    def host_pool_max_bytes(self) -> int:
        return self._budget.host_pool_max_bytes

    @host_pool_max_bytes.setter
    def host_pool_max_bytes(self, value: int) -> None:
        self._budget.host_pool_max_bytes = value

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
        calls = self._interceptor
        layer.attach(partial(calls.pre_forward, layer), partial(calls.post_forward, layer))
        self._layers[layer_id] = layer
        self.set_policy(layer_id, policy)

    def remove_layer(self, layer_id: int) -> nn.Module:
        """Stop managing a layer (it migrates away); its saved tensors must all be gone."""
        layer = self._layer(layer_id)
        live = self._engine.live_micro_batches(layer_id)
        live.update(self._interceptor.counted_micro_batches(layer_id))
        if live:
            resident = sum(self.ledger.resident_of(layer_id).values())
            raise LayerBusyError(
                f"layer {layer_id} still has saved activations of micro-batches {sorted(live)} "
                f"({format_bytes(resident)} on the device); run their backward before removing the layer"
            )
        self._detach(layer)
        del self._layers[layer_id]
        self._all_keep = all(other.policy is Policy.KEEP for other in self._layers.values())
        self._update_hooks()
        self.ledger.forget_layer(layer_id)
        self._budget.reset_reserve()
        return layer.module

    def retire_layer(self, layer_id: int) -> None:
        """The layer left the forward path (a streamed move switched it out): later micro-batches do not run it,
        so they are not counted with its bytes; it is removed once its in-flight micro-batches' backwards ran."""
        self._layer(layer_id).retired = True
        self._counts = None

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

    def _recomputed(self, layer_id: int, seconds: float) -> None:
        layer = self._layers.get(layer_id)
        if layer is not None:  # (a layer removed since holds no saved tensors: never recomputed)
            layer.recompute_s += seconds
            layer.recomputes += 1

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
        self._update_hooks()
        if policy is Policy.RECOMPUTE:
            forget_weight_places(layer.module)  # found anew at its first recompute call
            layer.route_forward(self._interceptor.forward_layer)
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
        self._budget.supersede_escalations()  # what the budget escalated before a plan is the plan's now

    def apply_plan(self, plan: Plan) -> None:
        """Set this stage's policies from a plan (layers it does not list are kept, D)."""
        self.set_policies({lid: plan.policy(lid) for lid in self._layers})

    # ================================================================== contexts
    @contextmanager
    def micro_batch(self, mb_id: int, inputs: tuple[Any, ...] | None = None) -> Iterator[TensorManager]:
        """Around one micro-batch's forward: its saved tensors are managed and attributed to ``mb_id``.

        ``inputs``: the stage's inputs of this micro-batch (``()`` where they come from the previous stage, whose
        shapes the pipeline fixes). Under a budget, kept layers run without hooks only when these are given and
        have the shapes the layers were measured with.
        """
        if self.begin_quiet_forward(mb_id, inputs):
            try:
                yield self
            finally:
                self.end_quiet_forward(mb_id)
            return
        self._check_open()
        calls = self._interceptor
        if calls.mb is not None:
            raise RuntimeError(f"micro-batch {mb_id}'s forward started inside micro-batch {calls.mb}'s forward")
        grad = torch.is_grad_enabled()
        if grad:
            self._input_shapes = None if inputs is None else input_shapes(inputs)
        self._begin_forward(mb_id)
        calls.mb = mb_id
        budget = self._budget
        start, swaps = self.ledger.resident, budget.swaps
        measured = grad and not calls.unmetered and self._all_keep
        try:
            yield self
        finally:
            calls.mb = None
            if self._hookless and grad:
                self._count_unhooked(mb_id)
            self._engine.flush_swap_outs()
            self._engine.poll()
            if measured and budget.swaps == swaps:
                # what one micro-batch keeps, each storage once: the schedule's own footprint per micro-batch
                budget.measured_kept(self.ledger.resident - start)

    # A quiet micro-batch: the layers carry no hooks and nothing saved through them is alive, so its forward
    # or full backward has nothing to release, copy, fetch or decide, only its count to keep. The begin/end
    # pairs below are the whole of vpipe's work around it; they run between a step's tensor work with cold
    # caches, so they do as little as they can in as few calls.
    def begin_quiet_forward(self, mb: int, inputs: tuple[Any, ...] | None = None) -> bool:
        """Start ``mb``'s forward if it is quiet (then :meth:`end_quiet_forward` must follow); False: it is not,
        use :meth:`micro_batch` (see there for ``inputs``)."""
        calls = self._interceptor
        if (not self._quiet_ready and not self._became_quiet()) or calls.mb is not None \
                or not torch.is_grad_enabled():
            return False
        if self._budget.budget_bytes is not None and (inputs is None or input_shapes(inputs) != self._input_shapes):
            # new shapes (or unknown ones) under a budget: the hooks come back and this micro-batch is measured
            self._input_shapes = None
            self._update_hooks()
            return False
        if self._prefetcher.predictor.observe(FORWARD, mb):  # a new step: remember how many were in flight
            self._new_step()
        calls.uncount(mb)  # a micro-batch of a step that failed before its backward
        calls.unmetered = True
        opened = self._open
        opened.add(mb)
        if len(opened) > self._open_max:
            self._open_max = len(opened)
        return True

    def end_quiet_forward(self, mb: int) -> None:
        self._count_unhooked(mb)

    def begin_quiet_backward(self, mb: int, phase: str) -> bool:
        """Start ``mb``'s backward phase if it is a quiet full backward (then :meth:`end_quiet_backward` must
        follow); False: use :meth:`backward`."""
        if phase != "full" or (not self._quiet_ready and not self._became_quiet()) or self._phases.lagging:
            return False
        self._prefetcher.predictor.observe(BACKWARD, mb)
        return True

    def end_quiet_backward(self, mb: int) -> None:
        self._open.discard(mb)
        self._interceptor.uncount(mb)

    def quiet_for_a_step(self, same_inputs: bool, stream: bool = False) -> bool:
        """Between steps: whether a whole step's micro-batches would all be quiet, so that the stage may run them
        without calling the manager at all (:meth:`StageHandle.run_plain`). Besides the layers running without
        hooks with nothing saved through them alive, no micro-batch may be inside a forward or between its
        backward passes, and none in flight (a flush schedule between steps has none) or, with ``stream`` (a
        schedule whose micro-batches stay in flight across steps), none in flight that is more than counted.
        Under a budget the step's inputs must have the shapes of the last step's (``same_inputs``): each
        micro-batch of that step was quiet with its shapes checked, or was measured."""
        calls = self._interceptor
        if not (self._quiet_ready or self._became_quiet()) or calls.mb is not None or self._phases.lagging:
            return False
        if not same_inputs and self._budget.budget_bytes is not None:
            return False
        return self._open <= calls.counted.keys() if stream else not self._open and not calls.counted

    def forget_in_flight(self) -> None:
        """A stream's stage runs without the manager from this step: the backwards of its micro-batches in flight
        will not be seen, so their counts go now (their forwards were quiet: counted, nothing else)."""
        self.end_of_step()
        self._open.clear()

    def count_in_flight(self, mbs: Iterable[int]) -> None:
        """A stream's stage calls the manager again from this step: count the micro-batches its forwards left in
        flight while it did not, as their quiet forwards would have."""
        for mb in mbs:
            self._interceptor.uncount(mb)
            self._open.add(mb)
            self._count_unhooked(mb)
        self._open_max = max(self._open_max, len(self._open))

    def _became_quiet(self) -> bool:
        """Whether the layers run without hooks and nothing saved through them is alive any more. It stays so
        until the hooks change (nothing can be saved through hooks that are not there), so it is remembered."""
        self._quiet_ready = self._hookless and not self._closed and self._engine.idle and self._recompute.idle
        return self._quiet_ready

    def _count_unhooked(self, mb: int) -> None:
        counts = self._counts
        if counts is None:
            counts = self._counts = [(lid, layer.kept_bytes or 0) for lid, layer in self._layers.items()
                                     if not layer.retired]
        self._interceptor.count_unhooked(mb, counts)

    def _new_step(self) -> None:
        self._open_max_last_step, self._open_max = self._open_max, 0
        self._phases.new_step()

    def _begin_forward(self, mb: int) -> None:
        engine = self._engine
        engine.drain()
        self._recompute.drain()
        engine.poll()
        if self._prefetcher.observe(FORWARD, mb):  # a new step: remember how many were in flight in the last
            self._new_step()
        calls = self._interceptor
        calls.unmetered = False
        if not torch.is_grad_enabled():
            return  # an evaluation forward saves nothing and has no backward
        calls.uncount(mb)  # a micro-batch of a step that failed before its backward
        self._open.add(mb)
        self._open_max = max(self._open_max, len(self._open))
        in_flight = max(self._open_max_last_step, len(self._open), 1)
        budget = self._budget
        if budget.budget_bytes is not None:
            budget.fit(mb, in_flight, self._phases.lag_share(in_flight), self._all_keep, self.set_policy)
        calls.unmetered = not self.metering and self._all_keep and budget.holds_next_unwatched(in_flight)
        self._prefetcher.pump()

    @contextmanager
    def backward(self, mb_id: int, phase: str = "full") -> Iterator[TensorManager]:
        """Around one backward phase of a micro-batch: prefetch ordering and release bookkeeping.

        ``phase`` is ``"full"``, or ``"input"`` then ``"weight"`` for schedules that split the
        backward (zero bubble): what the input pass brings back or recomputes and the weight
        pass needs stays on the device between the two (counted as resident), everything else
        goes after the input pass; the micro-batch holds its bytes until its weight pass ends.
        """
        if self.begin_quiet_backward(mb_id, phase):
            try:
                yield self
            finally:
                self.end_quiet_backward(mb_id)
            return
        if phase not in PHASES:
            raise ValueError(f"backward phase must be 'full', 'input' or 'weight', got {phase!r}")
        self._prefetcher.observe(BACKWARD, mb_id)
        dropped = self._phases.begin(mb_id, phase)
        try:
            self._prefetcher.pump()
            yield self
        finally:
            self._phases.end(mb_id, phase, dropped)
            self._engine.poll()
            if phase != "input":
                self._open.discard(mb_id)
                self._interceptor.uncount(mb_id)

    def prefetch(self, mb_id: int) -> bool:
        """Start bringing ``mb_id``'s swapped tensors back now; False if the budget held some back."""
        return self._prefetcher.prefetch(mb_id)

    def end_of_step(self) -> None:
        """Every micro-batch's backward has run (a hand-written loop's ``optimizer.step()``): none is counted."""
        calls = self._interceptor
        for mb in list(calls.counted):
            calls.uncount(mb)

    # ================================================================== reporting
    def stats(self) -> TensorManagerStats:
        return collect_stats(layers=self._layers, ledger=self.ledger, engine=self._engine, swap_in=self._swap_in,
                             recompute=self._recompute, budget=self._budget, phases=self._phases,
                             interceptor=self._interceptor)

    def layer_saved_bytes(self) -> dict[int, int]:
        """Per layer, the activation bytes one micro-batch saves (largest seen; 0 if never run)."""
        return {lid: self.ledger.activation_bytes(lid) or 0 for lid in sorted(self._layers)}

    def summary(self) -> dict[str, Any]:
        """What a monitor reads twice per sampled step, without :meth:`stats`'s per-layer detail: saved bytes
        per layer and per micro-batch (each storage once), the host pool's gauges, cumulative copy and
        recompute figures."""
        engine = self._engine
        with engine.lock:
            engine.drain()
            engine.poll()
            pool = engine.pool if engine.has_pool else None
            copies = engine.copies
            return {"activation_bytes": self.layer_saved_bytes(),
                    "kept_bytes_per_mb": self._budget.kept_per_mb_now(),
                    "host_pool_used_bytes": pool.used_bytes if pool else 0,
                    "host_pool_peak_bytes": pool.peak_used_bytes if pool else 0,
                    "host_pool_capacity_bytes": pool.capacity_bytes if pool else 0,
                    "d2h_bytes": copies.bytes[D2H], "d2h_s": copies.seconds[D2H],
                    "h2d_bytes": copies.bytes[H2D], "h2d_s": copies.seconds[H2D],
                    "recompute_s": self._recompute.recompute_s}

    def keep_all_need(self) -> tuple[int, int]:
        """One micro-batch's kept bytes with every layer kept (each storage once; 0 until measured with the
        current layers) and the most micro-batches in flight in the last step (or this one)."""
        return self._budget.kept_per_mb_now(), max(self._open_max_last_step, self._open_max, 1)

    def keep_all_bytes(self) -> int:
        """What keeping every layer takes at the last step's peak (0 until measured)."""
        kept, in_flight = self.keep_all_need()
        return kept * in_flight

    def relax(self) -> None:
        """Between steps: go back to keeping the layers the budget made this manager swap or recompute, if
        keeping every layer fits the budget (see :meth:`BudgetGovernor.relax`)."""
        self._budget.relax(self.keep_all_bytes(), self.set_policy)

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
        self._quiet_ready = False
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
