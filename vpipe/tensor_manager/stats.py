"""What a tensor manager reports to the monitor: plain, immutable numbers."""

from __future__ import annotations

from dataclasses import dataclass, field

from vpipe.plan import Policy

__all__ = ["LayerStats", "TensorManagerStats"]


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
    lag_bytes: int | None = None  # kept between the input and the weight pass of a split backward, per micro-batch

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
    escalations: tuple[tuple[int, Policy, Policy], ...] = field(default_factory=tuple)
    live_saved_storages: int = 0
    multi_phase_storages: int = 0  # swapped storages freed after being unpacked by several backward passes
    weight_tensors_skipped: int = 0  # saves of parameters / stashed weights, left alone
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
