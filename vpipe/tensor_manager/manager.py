"""The tensor manager of one stage: keep (D), swap (S) or recompute (R) each layer's saved tensors.

:class:`TensorManager` is the facade the runtime, ``vpipe.attach`` and hand-written loops use: it owns
brackets each micro-batch's forward and each backward phase, and builds the parts that each do one
job, each with what it reads (once, in dependency order; the facade calls their methods, never sets
their fields):

* :mod:`.managed`: the managed layers and their policies;

* :mod:`.stores`: where saved tensors live, one value: the ledger, :mod:`.swap` (kept, swapped out),
  :mod:`.swap_in` (brought back), :mod:`.recompute_store` (recomputed calls);
* :mod:`.current_pass`: the backward pass unpacking now; :mod:`.phases`: backward phases and split
  backwards (what waits for a weight pass); :mod:`.governor`: the budget's decisions;
* :mod:`.prefetch`: when to bring tensors back; :mod:`.in_flight`: the micro-batches in flight;
* :mod:`.interception`: the layer and saved-tensor hooks (which call is managed, which tensor is
  kept or swapped, a layer under R runs through recompute slots);
* :mod:`.quiet`: the layers' hooks off, micro-batches only counted (``manager.quiet``, called by the
  stage wrappers directly); :mod:`.stats`: what it reports, through read-only views.

Where a swap is decided, issued, waited for and brought back: docs/tensor-manager.md. Nothing is
replaced: ``close()`` restores the modules exactly (:mod:`.layers`). The policy is read when the
layer is called, so a plan may change it between micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from vpipe.plan import Plan, Policy
from vpipe.tensor_manager.accounting import Ledger, format_bytes
from vpipe.tensor_manager.copy_engine import make_copy_engine
from vpipe.tensor_manager.current_pass import CurrentPass
from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.in_flight import InFlight
from vpipe.tensor_manager.interception import Interceptor
from vpipe.tensor_manager.layers import ManagedLayer, check_sizes
from vpipe.tensor_manager.managed import ManagedLayers
from vpipe.tensor_manager.phases import PHASES, BackwardPhases
from vpipe.tensor_manager.pool import DEFAULT_CHUNK_BYTES, HostPool, default_host_pool_bytes
from vpipe.tensor_manager.prefetch import ArrivalPredictor, Prefetcher
from vpipe.tensor_manager.quiet import QuietPath
from vpipe.tensor_manager.recompute_store import RecomputeStore
from vpipe.tensor_manager.stats import TensorManagerStats, collect_stats, collect_summary
from vpipe.tensor_manager.stores import SavedTensorStores
from vpipe.tensor_manager.swap import SwapEngine
from vpipe.tensor_manager.swap_in import SwapIn

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
        prefetch_alloc: str = "copy",
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        check_sizes(budget_bytes=budget_bytes, host_pool_bytes=host_pool_bytes, min_swap_bytes=min_swap_bytes)
        self.device = device
        pool_max = host_pool_bytes or default_host_pool_bytes()
        self.ledger = ledger = Ledger()
        self._layers: dict[int, ManagedLayer] = {}
        self._copies = make_copy_engine(device, prefetch_alloc)  # (refuses an unknown prefetch_alloc)
        host_pool = partial(HostPool, pool_max, pinned=self._copies.pinned, chunk_bytes=host_pool_chunk_bytes,
                            preallocate=True)
        self._engine = engine = SwapEngine(device, ledger, self._copies, host_pool)
        self._swap_in = SwapIn(engine)
        self._budget = budget = BudgetGovernor(budget_bytes, pool_max, ledger=ledger, engine=engine,
                                               layers=self._layers)
        current = CurrentPass()  # asked by both the phases and the recompute store
        self._recompute = RecomputeStore(device, ledger, engine.lock, current=current,
                                         may_keep=budget.may_keep,
                                         on_recompute=self._recomputed)
        self._stores = stores = SavedTensorStores(ledger, engine, self._swap_in, self._recompute)
        self._phases = BackwardPhases(stores=stores, current=current, budget=budget, layers=self._layers)
        self._order = ArrivalPredictor()  # the step's order of actions, told by _in_flight
        self._prefetcher = Prefetcher(self._swap_in, self._phases, budget, self._order)
        self._interceptor = Interceptor(device=device, min_swap_bytes=min_swap_bytes, stores=stores,
                                        budget=budget,
                                        phases=self._phases, prefetcher=self._prefetcher)
        self._in_flight = InFlight(self._order, self._phases.new_step)
        self.quiet = QuietPath(layers=self._layers, calls=self._interceptor, budget=budget,
                               phases=self._phases, in_flight=self._in_flight)
        self._managed = ManagedLayers(self, layers=self._layers, calls=self._interceptor, engine=engine,
                                      budget=budget, on_policies=self._policies_changed)
        # every call goes through the saved-tensor hooks while True; vpipe.attach lowers it on unsampled steps
        self._metering = True
        self._all_keep = True
        self._closed = False
        try:  # all or nothing: a bad layer or policy leaves no hook on the layers already taken
            for layer_id, module in layers.items():
                self.add_layer(layer_id, module)
            if policies:
                self.set_policies(policies)
        except BaseException:
            self.close()
            raise

    # ================================================================== settings
    @property
    def budget_bytes(self) -> int | None:
        """The device budget for saved activations (None: none); may be changed between micro-batches."""
        return self._budget.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int | None) -> None:
        self._budget.set_budget(value)
        self.quiet.update(self._metering, self._all_keep)

    @property
    def metering(self) -> bool:
        """Whether every layer call is measured through the hooks (vpipe.attach turns it off on the steps its
        monitor does not sample)."""
        return self._metering

    @metering.setter
    def metering(self, value: bool) -> None:
        if value == self._metering and self.quiet.hookless:
            return  # (set at every step: nothing to work out again while the layers run without hooks)
        self._metering = value
        self._interceptor.meter_recomputes(value)
        self.quiet.update(self._metering, self._all_keep)

    @property
    def hooked(self) -> bool:
        """Whether the layers' calls go through vpipe's hooks now (False: they run as without vpipe)."""
        return not self.quiet.hookless

    @property
    def min_swap_bytes(self) -> int:
        return self._interceptor.min_swap_bytes

    @min_swap_bytes.setter
    def min_swap_bytes(self, value: int) -> None:
        self._interceptor.swap_from(value)

    @property
    def host_pool_max_bytes(self) -> int:
        return self._budget.host_pool_max_bytes

    @host_pool_max_bytes.setter
    def host_pool_max_bytes(self, value: int) -> None:
        self._budget.set_host_pool_max(value)

    # ================================================================== layers and policies
    def add_layer(self, layer_id: int, module: nn.Module, policy: Policy | str = Policy.KEEP) -> None:
        """Manage one more layer (e.g. one that migrated to this stage); one not taken whole keeps no hook."""
        self._check_open()
        self._managed.add(layer_id, module, policy)

    def remove_layer(self, layer_id: int) -> nn.Module:
        """Stop managing a layer (it migrates away); its saved tensors must all be gone."""
        self._managed.get(layer_id)
        live = self._engine.live_micro_batches(layer_id)
        live.update(self._interceptor.counted_micro_batches(layer_id))
        if live:
            resident = sum(self.ledger.resident_of(layer_id).values())
            raise LayerBusyError(
                f"layer {layer_id} still has saved activations of micro-batches {sorted(live)} "
                f"({format_bytes(resident)} on the device); run their backward before removing the layer"
            )
        module = self._managed.remove(layer_id)
        self.ledger.forget_layer(layer_id)
        return module

    def retire_layer(self, layer_id: int) -> None:
        """The layer left the forward path (a streamed move switched it out): later
        micro-batches do not run it, so they are not counted with its bytes; it is
        removed once its in-flight micro-batches' backwards ran."""
        self._managed.get(layer_id).retire()
        self.quiet.forget_counts()

    @property
    def layer_ids(self) -> list[int]:
        return self._managed.ids

    def _recomputed(self, layer_id: int, seconds: float) -> None:
        layer = self._layers.get(layer_id)
        if layer is not None:  # (a layer removed since holds no saved tensors: never recomputed)
            layer.recomputed(seconds)

    def _policies_changed(self, all_keep: bool) -> None:
        self._all_keep = all_keep
        self.quiet.update(self._metering, all_keep)

    def policy(self, layer_id: int) -> Policy:
        return self._managed.get(layer_id).policy

    def policies(self) -> dict[int, Policy]:
        return self._managed.policies()

    def set_policy(self, layer_id: int, policy: Policy | str) -> None:
        """Takes effect at the layer's next call (the next micro-batch)."""
        self._check_open()
        self._managed.set(layer_id, policy)

    def set_policies(self, policies: Mapping[int, Policy | str]) -> None:
        self._check_open()
        self._managed.set_many(policies)

    def apply_plan(self, plan: Plan) -> None:
        """Set this stage's policies from a plan (layers it does not list are kept, D)."""
        self.set_policies({lid: plan.policy(lid) for lid in self._layers})

    # ================================================================== contexts
    @contextmanager
    def micro_batch(self, mb_id: int, inputs: tuple[Any, ...] | None = None) -> Iterator[TensorManager]:
        """Around one micro-batch's forward: its saved tensors are managed and attributed to ``mb_id``.

        ``inputs``: the stage's inputs of this micro-batch (``()`` where they come from the previous stage,
        whose shapes the pipeline fixes). Under a budget, kept layers run without hooks only when these are
        given and have the shapes the layers were measured with.
        """
        quiet = self.quiet
        if quiet.begin_forward(mb_id, inputs):
            try:
                yield self
            finally:
                quiet.end_forward(mb_id)
            return
        self._check_open()
        calls = self._interceptor
        if calls.forwarding:
            raise RuntimeError(f"micro-batch {mb_id}'s forward started inside micro-batch "
                               f"{calls.mb}'s forward")
        grad = torch.is_grad_enabled()
        if grad:
            quiet.measured_with(inputs)
        unmetered, held_back = self._begin_forward(mb_id)
        calls.begin_micro_batch(mb_id, unmetered, held_back)
        budget = self._budget
        start, swaps = self.ledger.resident, budget.swaps
        measured = grad and not unmetered and self._all_keep
        try:
            yield self
        finally:
            calls.end_micro_batch()
            if quiet.hookless and grad:
                quiet.count(mb_id)
            self._engine.flush_swap_outs()
            self._engine.poll()
            if measured and budget.swaps == swaps:
                # what one micro-batch keeps, each storage once: the schedule's own footprint per micro-batch
                budget.measured_kept(self.ledger.resident - start)

    def _begin_forward(self, mb: int) -> tuple[bool, frozenset[int]]:
        """Before ``mb``'s forward: release, fit the budget, start prefetches; returns whether its kept
        layers may skip the saved-tensor hooks, and the swapped layers that keep their tensors in it."""
        self._stores.release()
        self._engine.poll()
        flight = self._in_flight
        flight.forward_starts(mb)
        if not torch.is_grad_enabled():
            return False, frozenset()  # an evaluation forward saves nothing and has no backward
        self._interceptor.uncount(mb)  # a micro-batch of a step that failed before its backward
        flight.add(mb)
        in_flight = max(flight.max_last_step, len(flight.open), 1)
        budget, lag_share = self._budget, self._phases.lag_share(in_flight)
        if budget.budget_bytes is not None:
            budget.fit(mb, in_flight, lag_share, self._all_keep, self.set_policy)
        unmetered = not self.metering and self._all_keep and budget.holds_next_unwatched(in_flight)
        held_back: frozenset[int] = frozenset()
        # a swapped layer may keep what would come straight back, or what the room holds
        if not self._all_keep:
            later = max(0, flight.max_last_step - len(flight.open))
            held_back = budget.swaps_to_skip(mb, self._order, later, lag_share)
        self._prefetcher.pump()
        return unmetered, held_back

    @contextmanager
    def backward(self, mb_id: int, phase: str = "full") -> Iterator[TensorManager]:
        """Around one backward phase of a micro-batch: prefetch ordering and release bookkeeping.

        ``phase`` is ``"full"``, or ``"input"`` then ``"weight"`` for schedules that split the
        backward (zero bubble): what the input pass brings back or recomputes and the weight
        pass needs stays on the device between the two (counted as resident), everything else
        goes after the input pass; the micro-batch holds its bytes until its weight pass ends.
        """
        quiet = self.quiet
        if quiet.begin_backward(mb_id, phase):
            try:
                yield self
            finally:
                quiet.end_backward(mb_id)
            return
        if phase not in PHASES:
            raise ValueError(f"backward phase must be 'full', 'input' or 'weight', got {phase!r}")
        self._in_flight.backward_starts(mb_id)
        dropped = self._phases.begin(mb_id, phase)
        try:
            self._prefetcher.pump()
            yield self
        finally:
            self._phases.end(mb_id, phase, dropped)
            self._engine.poll()
            if phase != "input":
                self._in_flight.ended(mb_id)
                self._interceptor.uncount(mb_id)

    def prefetch(self, mb_id: int) -> bool:
        """Start bringing ``mb_id``'s swapped tensors back now; False if the budget held some back."""
        return self._prefetcher.prefetch(mb_id)

    def end_of_step(self) -> None:
        """Every micro-batch's backward ran (a step, a loop's ``optimizer.step()``):
        none is counted, none holds."""
        self._interceptor.uncount_all()
        self._phases.retire()

    # ================================================================== reporting
    def stats(self) -> TensorManagerStats:
        return collect_stats(layers=self._layers, saved=self._stores, budget=self._budget,
                             lag_resident_bytes=self._phases.lag_resident_bytes,
                             intercepted=self._interceptor)

    def layer_saved_bytes(self) -> dict[int, int]:
        """Per layer, the activation bytes one micro-batch saves (largest seen; 0 if never run)."""
        return {lid: self.ledger.activation_bytes(lid) or 0 for lid in sorted(self._layers)}

    def summary(self) -> dict[str, Any]:
        """What a monitor reads twice per sampled step (see :func:`.stats.collect_summary`)."""
        return collect_summary(layers=self._layers, saved=self._stores, budget=self._budget)

    def keep_all_need(self) -> tuple[int, int]:
        """One micro-batch's kept bytes with every layer kept (each storage once; 0 until measured with the
        current layers) and the most micro-batches in flight in the last step (or this one)."""
        return self._budget.kept_per_mb_now(), self._in_flight.peak()

    def keep_all_bytes(self) -> int:
        """What keeping every layer takes at the last step's peak (0 until measured)."""
        kept, in_flight = self.keep_all_need()
        return kept * in_flight

    def relax(self) -> None:
        """Between steps: go back to keeping the layers the budget made this manager swap or recompute, if
        keeping every layer fits the budget (see :meth:`BudgetGovernor.relax`)."""
        self._budget.relax(self.keep_all_bytes(), self.set_policy)

    def reset_peak(self) -> None:
        self._stores.release()
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
        self.quiet.close()
        self._managed.detach_all()

    def __enter__(self) -> TensorManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        pol = "".join(layer.policy.value for _, layer in sorted(self._layers.items()))
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (f"TensorManager(device={self.device}, layers={self.layer_ids}, "
                f"policies={pol}, budget={budget})")
