"""The stage's device memory budget at run time: what may stay resident, and what to escalate.

The projection itself is :mod:`.budget` (pure functions over measured layers). This object
applies it for one tensor manager and keeps what its decisions need between calls: the
budget, the backward's *reserve* (the largest activation of one layer and micro-batch
seen: what a backward brings back or recomputes at once), whether keeping everything fits
(then nothing is brought back and no reserve is needed), the bytes one micro-batch keeps
when every layer is kept, and what it decided (tensors swapped for the budget, policy
escalations, each logged as a ``policy`` decision).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

from vpipe.log import decision
from vpipe.plan import Policy
from vpipe.tensor_manager.accounting import Ledger
from vpipe.tensor_manager.budget import LayerEstimate, check_layer_fits, fit_micro_batch, kept_bytes
from vpipe.tensor_manager.copy_engine import D2H
from vpipe.tensor_manager.layers import ManagedLayer
from vpipe.tensor_manager.swap import SwapEngine

__all__ = ["BudgetGovernor", "StepOrder"]

# The share of a micro-batch's forward its swap-outs hide behind (budget.exposed_copy_s): all of it
# where a copy stream runs beside the compute, none where copies run on the compute thread.
_SWAP_OVERLAP = {"cpu": 0.0, "cuda": 1.0}


class StepOrder(Protocol):
    """The schedule's order of actions as learned from the last step (:class:`.prefetch.ArrivalPredictor`)."""

    def backward_follows(self, mb: int) -> bool: ...

    def backward_first(self, mb: int) -> bool: ...


class BudgetGovernor:
    """Budget decisions of one tensor manager (``budget_bytes`` None: no budget, everything allowed)."""

    def __init__(self, budget_bytes: int | None, host_pool_max_bytes: int, *, ledger: Ledger,
                 engine: SwapEngine,
                 layers: Mapping[int, ManagedLayer]) -> None:
        self.budget_bytes = budget_bytes
        self.host_pool_max_bytes = host_pool_max_bytes
        self.ledger = ledger
        self._engine = engine
        self._layers = layers  # the manager's, read only
        # largest activation of one layer and micro-batch seen: what a backward brings back or recomputes at
        # once; a stage that keeps everything, and fits so, brings nothing back and needs none (limit())
        self.reserve = 0
        self.keep_all_fits = False  # the last projection found that keeping everything fits
        self.kept_per_mb: int | None = None  # resident bytes a metered micro-batch added, every layer kept
        self._kept_layers: frozenset[int] = frozenset()  # the layers managed when kept_per_mb was measured
        self.swaps = 0  # tensors swapped because keeping them would pass the budget
        # times a pack waited for swap-outs still copying to free the device bytes it needed, and for how
        # long: copies that did not keep up with the forward
        self.waits = 0
        self.wait_s = 0.0
        self.escalations: list[tuple[int, Policy, Policy]] = []
        self._relaxed = 0  # escalations before this index are undone or superseded

    def set_budget(self, budget_bytes: int | None) -> None:
        """The budget from the next micro-batch on (None: none; a rank shares its budget anew as its stages
        measure)."""
        self.budget_bytes = budget_bytes

    def set_host_pool_max(self, nbytes: int) -> None:
        """What the host pool may grow to, as the projection counts it."""
        self.host_pool_max_bytes = nbytes

    # ------------------------------------------------------------------ per tensor
    def limit(self) -> int | None:
        """What the resident saved bytes may reach: the budget less the backward's reserve."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - (0 if self.keep_all_fits else self.reserve)

    def may_keep(self, transient_bytes: int) -> bool:
        """Whether a recomputed tensor may stay for the weight pass: the resident total, less the
        recompute's tensors about to go, stays within the budget less the backward's reserve."""
        limit = self.limit()
        return limit is None or self.ledger.resident - transient_bytes <= limit

    def forces_swap(self, key: int, nbytes: int) -> bool:
        """Whether keeping this storage would pass the budget less the reserve (frees what it can
        first); if so it is swapped although its layer keeps, and counted."""
        if self._over_budget(key, nbytes):
            self.swaps += 1
            return True
        return False

    def _over_budget(self, key: int, nbytes: int) -> bool:
        engine = self._engine
        existing = engine.lookup(key)
        if existing is not None and not existing.swapped:
            return False  # already resident: keeping it costs nothing more
        limit = self.limit()
        assert limit is not None
        if self.ledger.resident + nbytes <= limit:
            return False
        engine.poll()
        if engine.swap_outs_in_flight:
            started = time.perf_counter()
            engine.wait_swap_outs(limit - nbytes)
            self.waits += 1
            self.wait_s += time.perf_counter() - started
        if self.ledger.resident + nbytes <= limit:
            return False
        return self._pool_free_bytes() >= nbytes

    def _pool_free_bytes(self) -> int:
        engine = self._engine
        return self.host_pool_max_bytes - (engine.pool.used_bytes if engine.has_pool else 0)

    # ------------------------------------------------------------------ per layer call
    def note_activation(self, activation_bytes: int) -> None:
        """A layer call saved this much: the reserve covers the largest."""
        if activation_bytes > self.reserve:
            self.reserve = activation_bytes

    def check_fits(self, layer_id: int, activation_bytes: int) -> None:
        """A layer whose activations alone pass the budget cannot run: MemoryBudgetError naming it."""
        if self.budget_bytes is not None:
            check_layer_fits(layer_id, activation_bytes, self.budget_bytes)

    def reset_reserve(self) -> None:
        """The managed layers changed (one was removed): the reserve is the largest one left."""
        self.reserve = max((self.ledger.activation_bytes(lid) or 0 for lid in self._layers), default=0)

    def measured_kept(self, per_mb: int) -> None:
        """A metered micro-batch kept every layer's tensors: ``per_mb`` bytes, each storage once."""
        self.kept_per_mb = per_mb
        self._kept_layers = frozenset(self._layers)

    def kept_per_mb_now(self) -> int:
        """``kept_per_mb`` if it was measured with the layers managed now; else, once every
        layer's activations were measured, their sum (a storage two layers save counts
        twice: never less than keeping takes); 0 when not known.

        A stage that escalated at its first micro-batches (its part of a shared budget was not known yet)
        never runs a micro-batch with every layer kept to measure it: the sum lets it find out that keeping
        every layer fits after all."""
        if self.kept_per_mb is not None and self._kept_layers == self._layers.keys():
            return self.kept_per_mb
        sizes = [self.ledger.activation_bytes(lid) for lid in self._layers]
        return sum(sizes) if sizes and None not in sizes else 0  # type: ignore[arg-type]

    # ------------------------------------------------------------------ per micro-batch
    def fit(self, mb: int, in_flight: int, lag_share: float, all_keep: bool,
            set_policy: Callable[[int, Policy], None]) -> None:
        """Before micro-batch ``mb``'s forward: escalate the cheapest layers until the projection fits.

        ``in_flight``: micro-batches forwarded and not finished (now or in the last step);
        ``lag_share``: those between their input and weight pass, per micro-batch in flight.
        """
        budget = self.budget_bytes
        assert budget is not None
        # keeping everything needs no backward reserve (nothing is brought back or recomputed): when the
        # measured bytes of a micro-batch, every layer kept, fit that way, as much fits as without vpipe (what
        # relax() undoes escalations by: the two must agree, or a stage undoes and redoes them every step)
        kept = self.kept_per_mb_now()
        self.keep_all_fits = (all_keep and kept > 0
                              and kept <= min(budget - self.ledger.resident, budget // in_flight))
        if self.keep_all_fits:
            return  # (before the projection's estimates: this is every micro-batch of a stage that fits)
        estimates = self._estimates(lag_share)
        copies = self._engine.copies
        # (swap-outs still copying count as gone: a copy running late is a wait, not a reason to escalate)
        changes = fit_micro_batch(
            estimates, budget_bytes=budget,
                                  resident_bytes=self.ledger.resident - self._engine.outgoing_bytes(),
            reserve_bytes=self.reserve,
            in_flight=in_flight, pool_free_bytes=self._pool_free_bytes(),
            swap_s_per_byte=1.0 / copies.expected_bandwidth(D2H), overlap=_SWAP_OVERLAP[copies.kind],
            context=f"micro-batch {mb}",
        )
        for change in changes:
            set_policy(change.layer_id, change.new)
            self.escalations.append((change.layer_id, change.old, change.new))
            decision(
                "policy", f"layer {change.layer_id}: {change.old.value} -> "
                          f"{change.new.value} to fit the budget",
                layer=change.layer_id, old=change.old.value, new=change.new.value,
                     saved_bytes=change.saved_bytes,
                cost_s=change.cost_s, budget_bytes=budget, in_flight=in_flight, micro_batch=mb,
            )

    def swaps_to_skip(self, mb: int, order: StepOrder, later_forwards: int,
                      lag_share: float) -> frozenset[int]:
        """Swapped layers that micro-batch ``mb``, whose forward starts now, keeps on the device: swapping
        what would come straight back, or what the budget has room for, only costs copies.

        Without a budget only when its own backward is the next action in the learned ``order`` (the last
        micro-batch when the backwards start from it, every micro-batch of 1F1B's last stage): the backward's
        prefetch would bring it all back at once anyway. Under a budget, when its backward comes before those
        of the ``later_forwards`` still to come before the step's peak (else the room is theirs): what the
        room below the budget less the reserve holds once what is resident and, at their policies' footprint,
        this micro-batch and those are counted. Layers are kept from the last back: a backward needs them
        first. A kept tensor is still swapped at pack time if the budget has no room for it after all. Nothing
        under a split backward (``lag_share`` > 0): a kept layer would hold everything until its weight pass.
        """
        swapped = [lid for lid, layer in sorted(self._layers.items()) if layer.policy is Policy.SWAP]
        if not swapped or lag_share > 0:
            return frozenset()
        if self.budget_bytes is None:
            return frozenset(swapped) if order.backward_follows(mb) else frozenset()
        if not order.backward_first(mb):  # (also before the first step is learned: the peak is not known)
            return frozenset()
        estimates = {e.layer_id: e for e in self._estimates(lag_share)}
        limit = self.limit()
        assert limit is not None
        footprint = sum(kept_bytes(e, e.policy) for e in estimates.values())
        room = limit - self.ledger.resident - footprint * (later_forwards + 1)
        held: list[int] = []
        for lid in reversed(swapped):
            e = estimates.get(lid)
            if e is None or e.swappable_bytes > room:
                break
            room -= e.swappable_bytes
            held.append(lid)
        return frozenset(held)

    def relax(self, need: int, set_policy: Callable[[int, Policy], None]) -> None:
        """Undo the escalations in force once keeping every layer
        (``need`` bytes at the peak) fits the budget.

        A stage may escalate before it knows what it needs: on a rank whose stages share one
        budget, the shares are equal until each stage measured its need, and the projection of
        an unmeasured micro-batch adds a reserve. When the budget turns out to hold every
        layer kept, the stage keeps them, as without vpipe.
        """
        budget = self.budget_bytes
        active = self.escalations[self._relaxed:]
        if budget is None or not active or not need or need > budget:
            return
        after = {lid: layer.policy for lid, layer in self._layers.items()}
        for layer_id, old, new in reversed(active):
            if after.get(layer_id) is new:
                after[layer_id] = old
        if any(policy is not Policy.KEEP for policy in after.values()):
            # a plan's swaps or recomputes stay: not every layer would be kept, the micro-batches would
            # project with a backward reserve again and escalate again (undone and redone at every step)
            return
        self._relaxed = len(self.escalations)
        for layer_id, old, new in reversed(active):
            layer = self._layers.get(layer_id)
            if layer is None or layer.policy is not new:
                continue  # gone, or a plan set its policy since
            set_policy(layer_id, old)
            decision("policy",
                     f"layer {layer_id}: {new.value} -> {old.value}, every layer kept fits the budget",
                     layer=layer_id, old=new.value, new=old.value, need_bytes=need, budget_bytes=budget)

    def supersede_escalations(self) -> None:
        """Policies were set from outside (a plan): the escalations made before are no longer to undo."""
        self._relaxed = len(self.escalations)

    def _estimates(self, lag_share: float) -> list[LayerEstimate]:
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

    def holds_unwatched(self, in_flight: int) -> bool:
        """Whether ``in_flight`` micro-batches, every layer kept and counted with its measured bytes, fit the
        budget (then no call needs watching until the budget, the layers or the shapes change: with inputs of
        the measured shapes a layer saves what it saved when measured); always without a budget.

        No margin on top: the plain schedule runs wherever its footprint fits, and so must vpipe's kept layers
        (a margin made a rank whose step fills 94% of its budget pay for hooks that plain does not have)."""
        if self.budget_bytes is None:
            return True
        per_mb = self._kept_bytes_if_fits()
        return per_mb is not None and in_flight * per_mb <= self.budget_bytes

    def _kept_bytes_if_fits(self) -> int | None:
        """One micro-batch's bytes, every layer kept and counted with its measured bytes,
        if keeping every layer fits the budget (else None)."""
        if not self.keep_all_fits:
            return None
        per_mb = 0
        for layer in self._layers.values():
            if layer.kept_bytes is None:
                return None
            per_mb += layer.kept_bytes
        return per_mb

    def holds_next_unwatched(self, in_flight: int) -> bool:
        """Whether the next micro-batch, every layer kept and counted with its measured
        bytes, fits the room left (always, without a budget)."""
        if self.budget_bytes is None:
            return True
        per_mb = self._kept_bytes_if_fits()
        if per_mb is None:
            return False
        usable = self.budget_bytes  # every layer kept: no backward reserve
        room = min(usable - self.ledger.resident, usable // in_flight)
        return per_mb <= room
