"""Backward passes and split backwards (zero bubble): which pass runs, and what waits for the weight pass.

A backward runs in phases bracketed by the manager's ``backward()``: ``"full"``, or, for
the zero-bubble schedules that split a backward, ``"input"`` (input gradients,
``retain_graph``) and later ``"weight"`` (weight gradients). In the input pass every
unpack of a swapped or recomputed tensor asks autograd whether the node unpacking it runs
again in the weight pass (:meth:`.current_pass.CurrentPass.needed_by_weight_pass`); those
tensors stay on the device until the weight pass used them, so each is fetched once and
each layer call recomputed once, and the bytes they hold count as resident. A swapped
tensor is brought back for the pass unpacking it here (:meth:`BackwardPhases.restore`).

A micro-batch between its two passes is *lagging*. The budget's projection counts what
lagging micro-batches hold (measured here per layer into the ledger's ``lag``, see
:mod:`.budget`), and if keeping it would pass the budget at the end of an input pass the
largest are dropped (fetched or recomputed again for the weight pass, counted and logged
as one ``weight_pass_drop`` decision).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from vpipe.log import decision
from vpipe.plan import Policy
from vpipe.tensor_manager.accounting import format_bytes
from vpipe.tensor_manager.current_pass import CurrentPass
from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.handles import StorageEntry, SwappedHandle
from vpipe.tensor_manager.layers import ManagedLayer
from vpipe.tensor_manager.stores import SavedTensorStores

__all__ = ["BackwardPhases", "PHASES"]

PHASES = ("full", "input", "weight")

# per layer, bytes kept for weight passes that the budget dropped so far: (swapped, recomputed)
Dropped = tuple[dict[int, int], dict[int, int]]


class BackwardPhases:
    """The backward phases of one tensor manager, and the micro-batches between an input and a weight pass.

    ``current`` is the pass running now (shared with the recompute store, which asks it too);
    ``stores`` hold what the phases keep or drop.
    """

    def __init__(self, *, stores: SavedTensorStores, current: CurrentPass, budget: BudgetGovernor,
                 layers: Mapping[int, ManagedLayer]) -> None:
        self.ledger = stores.ledger
        self._swap_in = stores.swap_in
        self._recompute = stores.recompute
        self._current = current
        self._budget = budget
        self._layers = layers  # the manager's, read only
        self.split = False  # an input phase was seen: this stage's backwards are split (zero bubble)
        self.lagging: set[int] = set()  # input pass done, weight pass not yet
        self._lag_max = 0
        self._lag_max_last_step = 0
        self._lag_kept: set[StorageEntry] = set()  # under a budget: kept storages flagged for the weight pass

    # ------------------------------------------------------------------ phases
    def begin(self, mb: int, phase: str) -> Dropped:
        """A backward phase of ``mb`` starts; returns what :meth:`end` needs back."""
        if phase == "input":
            self.split = True
            self.lagging.discard(mb)  # a new input pass (a retried step): not lagging until it ends
        self._current.enter(mb, phase)
        return self._dropped_bytes()

    def end(self, mb: int, phase: str, dropped_before: Dropped) -> None:
        """Drop what no later pass of ``mb`` needs; after an input pass keep the rest within the budget.

        What the weight pass needs stays on the device unless that passes the budget less the
        backward's reserve: then the largest copies go first (a copy back is cheaper than a
        forward), then recomputed tensors; the weight pass fetches or recomputes them again.
        """
        unpacked = self._current.leave()
        held = self._swap_in.end_phase(mb, phase, unpacked)
        recomputed = self._recompute.end_phase(mb, phase, unpacked)
        if phase != "input":
            self.lagging.discard(mb)
            self._lag_kept.clear()
            if phase == "weight":
                self.retire(mb)
            return
        self.lagging.add(mb)
        self._lag_max = max(self._lag_max, len(self.lagging))
        # what each layer of this micro-batch holds for its weight pass: the budget's projection uses it
        for entry in self._lag_kept:
            held[entry.layer] = held.get(entry.layer, 0) + entry.nbytes
        self._lag_kept.clear()
        for lid, nbytes in recomputed.items():
            held[lid] = held.get(lid, 0) + nbytes
        # what the budget dropped during the pass was needed too: the projection must count it
        for now, before in zip(self._dropped_bytes(), dropped_before):
            for lid, nbytes in now.items():
                if nbytes > before.get(lid, 0):
                    held[lid] = held.get(lid, 0) + nbytes - before.get(lid, 0)
        measured = self._budget.budget_bytes is not None  # kept layers were measured too (kept_unpacked)
        for lid, layer in self._layers.items():
            if lid in held or measured or layer.policy is not Policy.KEEP:
                self.ledger.lag[lid] = held.get(lid, 0)
        limit = self._budget.limit()
        if limit is not None and self.ledger.resident > limit:
            excess = self.ledger.resident - limit
            freed = self._swap_in.drop_held(mb, excess)
            if freed < excess:
                self._recompute.drop_held(mb, excess - freed)
        swapped, recomputed_bytes = (sum(now.values()) - sum(before.values())
                                     for now, before in zip(self._dropped_bytes(), dropped_before))
        if swapped or recomputed_bytes:
            decision(
                "weight_pass_drop",
                f"micro-batch {mb}: dropped {format_bytes(swapped + recomputed_bytes)} its "
                f"weight pass needs to stay under the budget ({format_bytes(swapped)} to fetch again, "
                f"{format_bytes(recomputed_bytes)} to "
                f"recompute again)", micro_batch=mb, swapped_bytes=swapped, recomputed_bytes=recomputed_bytes,
                budget_bytes=self._budget.budget_bytes, lagging=len(self.lagging),
            )

    def retire(self, mb: int | None = None) -> None:
        """The backward of ``mb`` (None: of every micro-batch, at the end of a step) is over: let go
        of what it still holds. Autograd may keep some of it: the input pass ran with
        ``retain_graph``, so the nodes only it ran keep their saved tensors while the graph lives,
        and a last stage's output that torch cannot detach in place (a view: a 3-d LM head's logits)
        keeps the graph alive until the next step. Nothing unpacks them any more: recomputed calls
        drop their inputs, and the storages left are released."""
        self._recompute.retire(mb)
        self._swap_in.engine.retire(mb)

    def _dropped_bytes(self) -> Dropped:
        return dict(self._swap_in.dropped_bytes), dict(self._recompute.dropped_bytes)

    def new_step(self) -> None:
        """A new step's first forward: remember how many micro-batches lagged at once in the last."""
        self._lag_max_last_step, self._lag_max = self._lag_max, len(self.lagging)

    # ------------------------------------------------------------------ unpacks
    @property
    def running(self) -> list[tuple[int, str]]:
        """(micro-batch, phase) of the backwards running now, innermost last."""
        return self._current.running

    def restore(self, handle: SwappedHandle) -> torch.Tensor:
        """A swapped tensor the running pass unpacks, on the device
        (kept for the weight pass if it needs it)."""
        current = self._current
        phase = current.unpack_phase()
        later = phase == "input" and current.needed_by_weight_pass()
        return self._swap_in.restore(handle, phase, current.serial, later, self._budget.limit())

    def kept_unpacked(self, entry: StorageEntry) -> None:
        """A kept storage was unpacked: under a budget an input pass also learns what kept layers'
        weight passes need (for the projection)."""
        running = self._current.running
        if (self._budget.budget_bytes is not None and running and running[-1][1] == "input"
                and self._current.needed_by_weight_pass()):
            self._lag_kept.add(entry)

    # ------------------------------------------------------------------ queries
    def fetch_phase(self, mb: int) -> str:
        """The backward phase a fetch for ``mb`` now serves."""
        running = self._current.running
        if running and running[-1][0] == mb:
            return running[-1][1]
        if mb in self.lagging:
            return "weight"
        return "input" if self.split else "full"

    def lag_share(self, in_flight: int) -> float:
        """Micro-batches between their input and weight pass per micro-batch in flight (last step or now)."""
        if not self.split:
            return 0.0
        return min(1.0, max(self._lag_max_last_step, len(self.lagging), 1) / in_flight)

    def lag_resident_bytes(self) -> int:
        """Device bytes lagging micro-batches hold for their weight pass now."""
        return sum(self._swap_in.held_bytes(mb) + self._recompute.held_bytes(mb) for mb in self.lagging)
