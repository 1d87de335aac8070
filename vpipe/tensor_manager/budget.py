"""The device memory budget of one stage: will the next micro-batch fit, and what to give up if not.

The tensor manager measures what each layer saves per micro-batch. Before a micro-batch's
forward it projects the resident saved bytes: what is resident now, plus what this
micro-batch will keep under the current policies, plus a working reserve for the backward
(the largest layer's activations, which a backward brings back or recomputes at once). If
the projection passes the budget, :func:`cheapest_escalations` picks extra swaps (D->S)
or recomputes (D->R, S->R), or swaps a recomputed layer that still keeps its inputs (R->S),
the cheapest seconds per byte saved first, until it fits.

A recompute costs the layer's forward. A swap costs the copy time its micro-batch's compute
does not hide (:func:`exposed_copy_s`): every swapped layer's copies share one copy engine
per direction, the swap-outs beside the micro-batch's forward and the swap-ins beside its
backward. Swaps are free until the copies fill that window; past it each byte more costs
its copy time, and recomputing the rest is often cheaper.

Zero-bubble schedules split a backward into an input pass and a weight pass that may run
much later. In between, a swapped layer keeps on the device the storages the weight pass
unpacks again (brought back once, for both passes) and a recomputed layer keeps those of
its recomputed tensors (recomputed once, for both); a kept layer holds everything anyway.
The manager measures these bytes per layer (``lag_bytes``) and how many micro-batches sat
between their two passes at once in the last step (``lagging``); the steady state then
counts ``in_flight`` micro-batches at their forward footprint plus ``lagging`` of them
also holding their lag bytes, spread over the micro-batches in flight as ``lag_share``.

A layer whose own activations for one micro-batch exceed the budget cannot run even when
fully recomputed (the recompute materialises them): that is a :class:`MemoryBudgetError`
naming the layer, not something to plan around.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from vpipe.plan import Policy
from vpipe.tensor_manager.accounting import format_bytes

__all__ = ["MemoryBudgetError", "LayerEstimate", "Escalation", "check_layer_fits", "cheapest_escalations",
           "exposed_copy_s", "fit_micro_batch", "kept_bytes", "stage_fixed_bytes", "expected_state_factor"]


class MemoryBudgetError(ValueError):
    """The stage's saved activations cannot be made to fit its device budget."""


@dataclass(frozen=True)
class LayerEstimate:
    """What one layer costs per micro-batch, as measured."""

    layer_id: int
    policy: Policy
    activation_bytes: int  # saved by one micro-batch when kept
    swappable_bytes: int  # the part of it a swap can move (tensors at or above the threshold)
    input_bytes: int  # what a recomputed micro-batch keeps: its inputs
    forward_s: float  # one forward, which is also what a recompute costs
    # kept between the input and the weight pass of a split backward (swapped or recomputed)
    lag_bytes: int = 0
    lag_share: float = 0.0  # lagging micro-batches per micro-batch in flight (0: the backward is not split)


@dataclass(frozen=True)
class Escalation:
    layer_id: int
    old: Policy
    new: Policy
    saved_bytes: int
    cost_s: float


def kept_bytes(e: LayerEstimate, policy: Policy) -> int:
    """Bytes a micro-batch of this layer leaves resident on the device under ``policy``.

    Under a split backward a swapped or recomputed layer also holds its ``lag_bytes`` while the
    micro-batch waits for its weight pass: ``lag_share`` of them per micro-batch in flight.
    """
    if policy is Policy.KEEP:
        return e.activation_bytes
    if policy is Policy.SWAP:
        lag = min(e.lag_bytes, e.swappable_bytes)
        return e.activation_bytes - e.swappable_bytes + math.ceil(e.lag_share * lag)
    lag = min(e.lag_bytes, e.activation_bytes)
    return min(e.input_bytes, e.activation_bytes) + math.ceil(e.lag_share * lag)


def stage_fixed_bytes(param_bytes: int, optimizer_state_bytes: int, weight_versions: int = 1) -> int:
    """What a stage holds whatever its activation policies: weights and gradients, optimizer
    state, and ``weight_versions - 1`` extra copies of the weights (PipeDream's stashes)."""
    return 2 * param_bytes + optimizer_state_bytes + max(0, weight_versions - 1) * param_bytes


def expected_state_factor(optimizer: Any) -> int:
    """Optimizer state per parameter byte before the state exists: Adam's two moments, SGD's momentum."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                              torch.optim.RAdam)):
        return 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return 0


def check_layer_fits(layer_id: int, activation_bytes: int, budget_bytes: int) -> None:
    if activation_bytes > budget_bytes:
        raise MemoryBudgetError(
            f"layer {layer_id} needs {format_bytes(activation_bytes)} of saved activations even fully "
            f"recomputed > budget {format_bytes(budget_bytes)}: a recompute materialises them all at once; "
            "raise the stage's budget, use smaller micro-batches, or split the layer"
        )


def exposed_copy_s(copy_s: float, forward_s: float, overlap: float) -> float:
    """Seconds of one micro-batch's swap copies that its compute does not hide.

    ``copy_s`` is one direction's copy time (the swap-outs; the swap-ins move the same bytes).
    The swap-outs run beside ``overlap`` of the micro-batch's ``forward_s``, the swap-ins beside
    its backward, about twice as long; what either direction carries past its window is
    exposed. ``overlap`` 0 (copies on the compute thread, as on CPU): every copy is paid.
    """
    window = overlap * forward_s
    return max(0.0, copy_s - window) + max(0.0, copy_s - 2.0 * window)


class _StepCost:
    """Seconds one micro-batch pays for its swaps and recomputes, under changing policies."""

    def __init__(self, estimates: dict[int, LayerEstimate], policies: dict[int, Policy],
                 swap_s_per_byte: float,
                 overlap: float) -> None:
        self._estimates = estimates
        self._s_per_byte = swap_s_per_byte
        self._overlap = overlap
        self._forward_s = sum(e.forward_s for e in estimates.values())
        self.copy_s = sum(self._copy_s(e) for lid, e in estimates.items() if policies[lid] is Policy.SWAP)

    def _copy_s(self, e: LayerEstimate) -> float:
        return e.swappable_bytes * self._s_per_byte

    def _copy_after(self, layer_id: int, old: Policy, new: Policy) -> float:
        e = self._estimates[layer_id]
        return (self.copy_s - (self._copy_s(e) if old is Policy.SWAP else 0.0)
                + (self._copy_s(e) if new is Policy.SWAP else 0.0))

    def cost(self, layer_id: int, old: Policy, new: Policy) -> float:
        """Extra seconds of moving a layer from ``old`` to ``new`` (never below 0)."""
        forward_s = self._estimates[layer_id].forward_s
        before = exposed_copy_s(self.copy_s, self._forward_s, self._overlap) + (
            forward_s if old is Policy.RECOMPUTE else 0.0)
        after = exposed_copy_s(self._copy_after(layer_id, old, new), self._forward_s, self._overlap) + (
            forward_s if new is Policy.RECOMPUTE else 0.0)
        return max(0.0, after - before)

    def apply(self, change: Escalation) -> None:
        self.copy_s = self._copy_after(change.layer_id, change.old, change.new)


def cheapest_escalations(
    estimates: Iterable[LayerEstimate],
    excess_bytes: int,
    *,
    swap_s_per_byte: float,
    overlap: float,
    pool_free_bytes: int,
    budget_bytes: int,
    context: str,
    best_effort: bool = False,
) -> list[Escalation]:
    """Policy changes that cut one micro-batch's resident bytes by ``excess_bytes``, cheapest first.

    A layer may go keep -> swap -> recompute, or recompute -> swap where swapping leaves less
    resident (its input is larger than what a swap keeps). With ``best_effort`` the changes
    found so far are returned when no further change helps, instead of raising.

    ``overlap`` is the share of a micro-batch's forward its swap-outs can hide behind
    (:func:`exposed_copy_s`; 0 when copies are synchronous, as on CPU). Raises
    :class:`MemoryBudgetError` when even every possible change does not save enough.
    """
    current = {e.layer_id: e for e in estimates}
    policies = {lid: e.policy for lid, e in current.items()}
    step = _StepCost(current, policies, swap_s_per_byte, overlap)
    pool_left = pool_free_bytes
    changes: list[Escalation] = []
    need = excess_bytes
    while need > 0:
        best: tuple[float, float, Escalation] | None = None
        for lid, e in current.items():
            old = policies[lid]
            for new in (Policy.SWAP, Policy.RECOMPUTE):
                saved = kept_bytes(e, old) - kept_bytes(e, new)
                if new is old or saved <= 0 or (new is Policy.SWAP and e.swappable_bytes > pool_left):
                    continue
                cost = step.cost(lid, old, new)
                # cheapest per byte; among equals the one that saves more, then the earlier layer
                key = (cost / saved, -saved)
                if best is None or key < best[:2]:
                    best = (key[0], key[1], Escalation(lid, old, new, saved, cost))
        if best is None:
            if best_effort:
                break
            raise MemoryBudgetError(
                f"{context}: {format_bytes(need)} more than the budget {format_bytes(budget_bytes)} "
                f"even with every layer swapped or recomputed; raise the budget or the host pool, "
                f"or run fewer micro-batches in flight"
            )
        change = best[2]
        changes.append(change)
        policies[change.layer_id] = change.new
        step.apply(change)
        if change.new is Policy.SWAP:
            pool_left -= current[change.layer_id].swappable_bytes
        need -= change.saved_bytes
    return changes


def fit_micro_batch(
    estimates: list[LayerEstimate],
    *,
    budget_bytes: int,
    resident_bytes: int,
    reserve_bytes: int,
    in_flight: int,
    pool_free_bytes: int,
    swap_s_per_byte: float,
    overlap: float,
    context: str,
) -> list[Escalation]:
    """The escalations the next micro-batch needs, given what is resident and how many are in flight.

    The projection is the larger of now (``resident_bytes`` plus this micro-batch) and the
    steady state (``in_flight`` micro-batches under the current policies, each with its
    share of what lagging micro-batches keep for their weight pass: :func:`kept_bytes`),
    plus the backward's reserve. Raises :class:`MemoryBudgetError` when even the steady state with
    every layer at its leanest cannot fit, not counting what lagging micro-batches keep for their
    weight pass: the manager can always drop that and fetch or recompute it again (slower, not
    larger), so a budget the lag does not fit in escalates as far as it can and leaves the rest
    to those drops.
    """
    if not estimates:
        return []
    per_mb = sum(kept_bytes(e, e.policy) for e in estimates)
    room_now = budget_bytes - reserve_bytes - resident_bytes
    room_steady = (budget_bytes - reserve_bytes) // in_flight
    target = max(0, min(room_now, room_steady))
    if per_mb <= target:
        return []

    def leanest(estimate: LayerEstimate) -> int:
        return min(kept_bytes(estimate, p) for p in Policy
                   if p is not Policy.SWAP or estimate.swappable_bytes <= pool_free_bytes)

    least = sum(leanest(e) for e in estimates)
    least_without_lag = sum(leanest(replace(e, lag_share=0.0)) for e in estimates)
    if in_flight * least_without_lag + reserve_bytes > budget_bytes:
        raise MemoryBudgetError(
            f"stage budget {format_bytes(budget_bytes)} cannot hold {in_flight} micro-batches in flight: "
            f"even with every layer swapped or recomputed each keeps {format_bytes(least_without_lag)}, plus "
            f"{format_bytes(reserve_bytes)} for the largest layer's backward"
        )
    # what is resident now may come from micro-batches run under older policies: do what can be
    # done for this one (the pool left may allow less than ``least`` assumed); the per-tensor check
    # at pack time covers the rest, so the steady-state check above is the only hard failure
    excess = per_mb - max(target, least)
    if excess <= 0:
        return []
    return cheapest_escalations(estimates, excess, swap_s_per_byte=swap_s_per_byte, overlap=overlap,
                                pool_free_bytes=pool_free_bytes, budget_bytes=budget_bytes, context=context,
                                best_effort=True)
