"""Backward passes and split backwards (zero bubble): which pass runs, and what waits for the weight pass.

A backward runs in phases bracketed by the manager's ``backward()``: ``"full"``, or, for
the zero-bubble schedules that split a backward, ``"input"`` (input gradients,
``retain_graph``) and later ``"weight"`` (weight gradients). In the input pass every
unpack of a swapped or recomputed tensor asks autograd whether the node unpacking it runs
again in the weight pass (:meth:`BackwardPhases.needed_by_weight_pass`); those tensors
stay on the device until the weight pass used them, so each is fetched once and each
layer call recomputed once, and the bytes they hold count as resident.

A micro-batch between its two passes is *lagging*. The budget's projection counts what
lagging micro-batches hold (measured here per layer into the ledger's ``lag``, see
:mod:`.budget`), and if keeping it would pass the budget at the end of an input pass the
largest are dropped (fetched or recomputed again for the weight pass, counted and logged
as one ``weight_pass_drop`` decision).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vpipe.log import decision
from vpipe.plan import Policy
from vpipe.tensor_manager.accounting import Ledger, format_bytes
from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.handles import StorageEntry
from vpipe.tensor_manager.layers import ManagedLayer
from vpipe.tensor_manager.recompute_store import RecomputeStore
from vpipe.tensor_manager.swap_in import SwapIn

__all__ = ["BackwardPhases", "PHASES"]

PHASES = ("full", "input", "weight")

# per layer, bytes kept for weight passes that the budget dropped so far: (swapped, recomputed)
Dropped = tuple[dict[int, int], dict[int, int]]


class BackwardPhases:
    """The backward phases running now, and the micro-batches between an input and a weight pass.

    ``recompute`` is set by the manager once the store exists (the store asks this object
    which pass unpacks; this object drops what the store holds).
    """

    recompute: RecomputeStore

    def __init__(self, *, ledger: Ledger, swap_in: SwapIn, budget: BudgetGovernor,
                 layers: Mapping[int, ManagedLayer]) -> None:
        self.ledger = ledger
        self._swap_in = swap_in
        self._budget = budget
        self._layers = layers  # the manager's, read only
        self.running: list[tuple[int, str]] = []  # (micro-batch, phase) of the backwards running now
        self.serial = 0  # numbers the backward() contexts (a storage unpacked in two is multi-phase)
        self.unpacked = False  # the running phase unpacked a swapped or recomputed tensor
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
        self.serial += 1
        self.running.append((mb, phase))
        self.unpacked = False
        return self._dropped_bytes()

    def end(self, mb: int, phase: str, dropped_before: Dropped) -> None:
        """Drop what no later pass of ``mb`` needs; after an input pass keep the rest within the budget.

        What the weight pass needs stays on the device unless that passes the budget less the
        backward's reserve: then the largest copies go first (a copy back is cheaper than a
        forward), then recomputed tensors; the weight pass fetches or recomputes them again.
        """
        self.running.pop()
        unpacked = self.unpacked
        held = self._swap_in.end_phase(mb, phase, unpacked)
        recomputed = self.recompute.end_phase(mb, phase, unpacked)
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
                self.recompute.drop_held(mb, excess - freed)
        swapped, recomputed_bytes = (sum(now.values()) - sum(before.values())
                                     for now, before in zip(self._dropped_bytes(), dropped_before))
        if swapped or recomputed_bytes:
            decision(
                "weight_pass_drop",
                f"micro-batch {mb}: dropped {format_bytes(swapped + recomputed_bytes)} its weight pass needs to stay "
                f"under the budget ({format_bytes(swapped)} to fetch again, {format_bytes(recomputed_bytes)} to "
                f"recompute again)", micro_batch=mb, swapped_bytes=swapped, recomputed_bytes=recomputed_bytes,
                budget_bytes=self._budget.budget_bytes, lagging=len(self.lagging),
            )

    def retire(self, mb: int | None = None) -> None:
        """The backward of ``mb`` (None: of every micro-batch, at the end of a step) is over: let go of what it
        still holds. Autograd may keep some of it: the input pass ran with ``retain_graph``, so the nodes only it
        ran keep their saved tensors while the graph lives, and a last stage's output that torch cannot detach
        in place (a view: a 3-d LM head's logits) keeps the graph alive until the next step. Nothing unpacks
        them any more: recomputed calls drop their inputs, and the storages left are released."""
        self.recompute.retire(mb)
        self._swap_in.engine.retire(mb)

    def _dropped_bytes(self) -> Dropped:
        return dict(self._swap_in.dropped_bytes), dict(self.recompute.dropped_bytes)

    def new_step(self) -> None:
        """A new step's first forward: remember how many micro-batches lagged at once in the last."""
        self._lag_max_last_step, self._lag_max = self._lag_max, len(self.lagging)

    # ------------------------------------------------------------------ unpacks
    def unpack_phase(self) -> str:
        """The phase of the backward unpacking now (``"full"`` outside any ``backward()``); marks it as used."""
        self.unpacked = True
        return self.running[-1][1] if self.running else "full"

    def kept_unpacked(self, entry: StorageEntry) -> None:
        """A kept storage was unpacked: under a budget an input pass also learns what kept layers'
        weight passes need (for the projection)."""
        running = self.running
        if (self._budget.budget_bytes is not None and running and running[-1][1] == "input"
                and self.needed_by_weight_pass()):
            self._lag_kept.add(entry)

    def needed_by_weight_pass(self) -> bool:
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
        if self.recompute.unpacking_inputs:
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

    # ------------------------------------------------------------------ queries
    def fetch_phase(self, mb: int) -> str:
        """The backward phase a fetch for ``mb`` now serves."""
        if self.running and self.running[-1][0] == mb:
            return self.running[-1][1]
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
        return sum(self._swap_in.held_bytes(mb) + self.recompute.held_bytes(mb) for mb in self.lagging)
