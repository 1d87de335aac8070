"""What a tensor manager reports to the monitor: plain, immutable numbers, gathered from its parts.

The monitor and the planner read these; :func:`collect_stats` takes one consistent reading
(under the swap engine's lock, after releasing what autograd let go of), :func:`collect_summary`
the few numbers a monitor reads on every sampled step. Both read the parts through the
read-only views below (what is saved, the budget, the layers), not the parts' classes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from vpipe.plan import Policy
from vpipe.tensor_manager.accounting import Ledger
from vpipe.tensor_manager.copy_engine import D2H, H2D

__all__ = ["LayerStats", "TensorManagerStats", "SavedCounters", "SavedView", "BudgetView", "LayerView",
           "collect_stats", "collect_summary"]


# ---------------------------------------------------------------------- what the statistics read
class LayerView(Protocol):
    """A managed layer's figures (:class:`.layers.ManagedLayer`)."""

    @property
    def policy(self) -> Policy: ...
    @property
    def forward_s(self) -> float | None: ...
    @property
    def recompute_s(self) -> float: ...
    @property
    def recomputes(self) -> int: ...
    @property
    def recompute_calls(self) -> int: ...


class CopyTotals(Protocol):
    """The copy engine's totals per direction (:class:`.copy_engine.CopyEngine`)."""

    @property
    def bytes(self) -> Mapping[str, int]: ...
    @property
    def seconds(self) -> Mapping[str, float]: ...
    def expected_bandwidth(self, direction: str) -> float: ...


class PoolGauges(Protocol):
    """The host pool's gauges (:class:`.pool.HostPool`)."""

    @property
    def used_bytes(self) -> int: ...
    @property
    def peak_used_bytes(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...


@dataclass(frozen=True)
class SavedCounters:
    """What the stores of saved tensors counted so far (see :class:`TensorManagerStats`)."""

    recompute_s: float
    sync_fallbacks: int
    prefetched: int
    live_saved_storages: int
    multi_phase_storages: int
    h2d_bytes_by_phase: dict[str, int]
    refetched_bytes: int
    repeat_recomputes: int
    lag_dropped: int


class SavedView(Protocol):
    """Where saved tensors live, read only (:class:`.stores.SavedTensorStores`)."""

    @property
    def ledger(self) -> Ledger: ...
    @property
    def copies(self) -> CopyTotals: ...
    @property
    def recompute_s(self) -> float: ...
    def settled(self) -> AbstractContextManager[None]: ...
    def pool(self) -> PoolGauges | None: ...
    def copied(self, layer: int) -> tuple[int, int]: ...
    def counters(self) -> SavedCounters: ...


class BudgetView(Protocol):
    """The budget and what it decided (:class:`.governor.BudgetGovernor`)."""

    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def host_pool_max_bytes(self) -> int: ...
    @property
    def swaps(self) -> int: ...
    @property
    def waits(self) -> int: ...
    @property
    def wait_s(self) -> float: ...
    @property
    def escalations(self) -> list[tuple[int, Policy, Policy]]: ...
    def kept_per_mb_now(self) -> int: ...


class InterceptedCounts(Protocol):
    """What the saved-tensor hooks counted (the interceptor)."""

    weights_skipped: int
    dtensors_swapped: int


# ---------------------------------------------------------------------- what they report
@dataclass(frozen=True)
class LayerStats:
    layer_id: int
    policy: Policy
    activation_bytes: dict[int, int]  # micro-batch -> bytes its forward saved (whatever the policy)
    input_bytes: int | None  # what a recomputed micro-batch keeps (its inputs), once seen under R
    resident_bytes: int  # held on the device by the manager now
    forward_s: float | None  # moving average of one forward
    recompute_s: float  # total spent recomputing this layer
    recomputes: int
    d2h_bytes: int
    h2d_bytes: int
    d2h_s: float  # bytes over the measured copy bandwidth
    h2d_s: float
    recompute_calls: int = 0  # managed calls under R: each should be recomputed once (``recomputes``)
    # kept between the input and the weight pass of a split backward, per micro-batch
    lag_bytes: int | None = None

    @property
    def activation_bytes_per_micro_batch(self) -> int:
        return max(self.activation_bytes.values(), default=0)


@dataclass(frozen=True)
class TensorManagerStats:
    layers: dict[int, LayerStats]
    resident_bytes: int
    peak_resident_bytes: int
    budget_bytes: int | None
    host_pool_used_bytes: int
    host_pool_peak_bytes: int
    host_pool_capacity_bytes: int  # allocated (pinned) so far
    host_pool_max_bytes: int  # what it may grow to
    d2h_bytes: int
    d2h_s: float
    h2d_bytes: int
    h2d_s: float
    recompute_s: float
    sync_fallbacks: int  # unpacks that found no prefetched copy and copied synchronously
    prefetched: int  # storages brought back ahead of their backward
    budget_swaps: int  # tensors swapped by the budget although their layer's policy keeps them
    budget_waits: int = 0  # packs that waited for swap-outs still copying, to stay within the budget
    budget_wait_s: float = 0.0  # and the seconds they waited: copies the compute did not hide
    escalations: tuple[tuple[int, Policy, Policy], ...] = field(default_factory=tuple)
    live_saved_storages: int = 0
    multi_phase_storages: int = 0  # swapped storages freed after being unpacked by several backward passes
    weight_tensors_skipped: int = 0  # saves of parameters / stashed weights, left alone
    dtensors_swapped: int = 0  # saved DTensors (tensor parallelism) whose local shard was swapped
    # split backwards (zero bubble): bytes brought back per phase ("full", "input", "weight"), bytes brought
    # back again for a storage already brought back once (0: every storage fetched once), recomputes of a
    # layer call beyond its first (0: every call recomputed once), what lagging micro-batches hold for their
    # weight pass now, and how many kept storages/tensors were dropped to stay under the budget
    h2d_bytes_by_phase: dict[str, int] = field(default_factory=dict)
    refetched_bytes: int = 0
    repeat_recomputes: int = 0
    lag_resident_bytes: int = 0
    lag_dropped: int = 0

    @property
    def policies(self) -> dict[int, Policy]:
        return {lid: s.policy for lid, s in self.layers.items()}


def collect_stats(*, layers: Mapping[int, LayerView], saved: SavedView, budget: BudgetView,
                  lag_resident_bytes: Callable[[], int],
                  intercepted: InterceptedCounts) -> TensorManagerStats:
    """The statistics of one tensor manager, from what its parts show (``lag_resident_bytes``: what
    micro-batches between the passes of a split backward hold now, read with the rest)."""
    with saved.settled():
        ledger, copies = saved.ledger, saved.copies
        d2h_bw, h2d_bw = copies.expected_bandwidth(D2H), copies.expected_bandwidth(H2D)
        per_layer = {}
        for lid, layer in sorted(layers.items()):
            d2h, h2d = saved.copied(lid)
            per_layer[lid] = LayerStats(
                layer_id=lid, policy=layer.policy,
                activation_bytes=dict(ledger.activation.get(lid, {})),
                input_bytes=ledger.inputs.get(lid),
                resident_bytes=sum(ledger.resident_of(lid).values()),
                forward_s=layer.forward_s, recompute_s=layer.recompute_s, recomputes=layer.recomputes,
                d2h_bytes=d2h, h2d_bytes=h2d, d2h_s=d2h / d2h_bw, h2d_s=h2d / h2d_bw,
                recompute_calls=layer.recompute_calls, lag_bytes=ledger.lag.get(lid),
            )
        pool = saved.pool()
        counted = saved.counters()
        return TensorManagerStats(
            layers=per_layer,
            resident_bytes=ledger.resident,
            peak_resident_bytes=ledger.peak,
            budget_bytes=budget.budget_bytes,
            host_pool_used_bytes=pool.used_bytes if pool else 0,
            host_pool_peak_bytes=pool.peak_used_bytes if pool else 0,
            host_pool_capacity_bytes=pool.capacity_bytes if pool else 0,
            host_pool_max_bytes=budget.host_pool_max_bytes,
            d2h_bytes=copies.bytes[D2H], d2h_s=copies.seconds[D2H],
            h2d_bytes=copies.bytes[H2D], h2d_s=copies.seconds[H2D],
            recompute_s=counted.recompute_s,
            sync_fallbacks=counted.sync_fallbacks,
            prefetched=counted.prefetched,
            budget_swaps=budget.swaps,
            budget_waits=budget.waits,
            budget_wait_s=budget.wait_s,
            escalations=tuple(budget.escalations),
            live_saved_storages=counted.live_saved_storages,
            multi_phase_storages=counted.multi_phase_storages,
            weight_tensors_skipped=intercepted.weights_skipped,
            dtensors_swapped=intercepted.dtensors_swapped,
            h2d_bytes_by_phase=counted.h2d_bytes_by_phase,
            refetched_bytes=counted.refetched_bytes,
            repeat_recomputes=counted.repeat_recomputes,
            lag_resident_bytes=lag_resident_bytes(),
            lag_dropped=counted.lag_dropped,
        )


def collect_summary(*, layers: Mapping[int, LayerView], saved: SavedView,
                    budget: BudgetView) -> dict[str, Any]:
    """What a monitor reads twice per sampled step, without :func:`collect_stats`'s
    per-layer detail: saved bytes per layer and per micro-batch (each storage once), the
    host pool's gauges, cumulative copy and recompute figures."""
    with saved.settled():
        ledger, copies, pool = saved.ledger, saved.copies, saved.pool()
        return {"activation_bytes": {lid: ledger.activation_bytes(lid) or 0 for lid in sorted(layers)},
                "kept_bytes_per_mb": budget.kept_per_mb_now(),
                "host_pool_used_bytes": pool.used_bytes if pool else 0,
                "host_pool_peak_bytes": pool.peak_used_bytes if pool else 0,
                "host_pool_capacity_bytes": pool.capacity_bytes if pool else 0,
                "d2h_bytes": copies.bytes[D2H], "d2h_s": copies.seconds[D2H],
                "h2d_bytes": copies.bytes[H2D], "h2d_s": copies.seconds[H2D],
                "recompute_s": saved.recompute_s}
