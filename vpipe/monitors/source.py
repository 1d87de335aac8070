"""What the monitor needs from whatever manages a stage's saved
activations, and from whatever moves its layers.

The tensor manager knows how many bytes each layer saves per micro-batch and what its
swap pool and copy streams did; the monitor only reads that. The contract is this
:class:`SavedTensorSource` protocol, so the real tensor manager plugs in without the
monitor knowing its type. :class:`~vpipe.monitors.keep_all.KeepAllSource` is the source
of a stage that keeps every activation (nothing swapped, nothing recomputed). What the
records say of the layers beyond what the monitor measures is a :class:`LayerFacts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

__all__ = ["SavedTensorStats", "SavedTensorSource", "TensorManagerSource", "LayerFacts"]


@dataclass(frozen=True)
class SavedTensorStats:
    """A reading of a saved-tensor source.

    Copy and recompute figures are *cumulative* since the source started (never
    decreasing), so the monitor can difference two readings over any window; the pool
    figures are gauges. ``host_pool_peak_bytes`` is the peak since the previous
    :meth:`SavedTensorSource.stats` call (reading restarts the window).
    """

    activation_bytes: Mapping[int, int] = field(default_factory=dict)  # layer id -> bytes per micro-batch
    # what one micro-batch keeps on the stage with every layer kept, each storage
    # once (0: not measured); below the sum of activation_bytes where layers save the
    # same tensor (a layer's output, its successor's input)
    kept_bytes_per_mb: int = 0
    host_pool_used_bytes: int = 0
    host_pool_peak_bytes: int = 0
    host_pool_capacity_bytes: int = 0
    d2h_bytes: int = 0
    d2h_s: float = 0.0
    h2d_bytes: int = 0
    h2d_s: float = 0.0
    recompute_s: float = 0.0


@runtime_checkable
class SavedTensorSource(Protocol):
    """Anything that can report a stage's saved-tensor statistics (the tensor manager)."""

    def stats(self) -> SavedTensorStats: ...


class TensorManagerSource:
    """The tensor manager as a :class:`SavedTensorSource` (its
    richer stats, reduced to what the monitor reads)."""

    def __init__(self, manager: object) -> None:
        self.manager = manager

    def stats(self) -> SavedTensorStats:
        return SavedTensorStats(**self.manager.summary())  # type: ignore[attr-defined]


class LayerFacts(Protocol):
    """A rank's layers as the records describe them: each stage's in model order, each block's kind (which
    blocks are alike, and which never move), and the kinds the rank can build (None: any)."""

    def layers_of(self, stage: int) -> list[int]: ...

    def layer_kind(self, block: nn.Module) -> str: ...

    def can_build(self) -> list[str] | None: ...
