"""Where one tensor manager's saved tensors live, as one value: the ledger that counts them, the swap engine
(kept and swapped out), the swap-in side (brought back) and the recompute store (recomputed calls).

The parts that read or release saved tensors are built with this value rather than with each
store; the statistics read it through :class:`.stats.SavedView`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from vpipe.tensor_manager.accounting import Ledger
from vpipe.tensor_manager.copy_engine import CopyEngine
from vpipe.tensor_manager.pool import HostPool
from vpipe.tensor_manager.recompute_store import RecomputeStore
from vpipe.tensor_manager.stats import SavedCounters
from vpipe.tensor_manager.swap import SwapEngine
from vpipe.tensor_manager.swap_in import SwapIn

__all__ = ["SavedTensorStores"]


@dataclass(frozen=True)
class SavedTensorStores:
    """The ledger and the three stores of saved tensors of one tensor manager."""

    ledger: Ledger
    engine: SwapEngine
    swap_in: SwapIn
    recompute: RecomputeStore

    @property
    def idle(self) -> bool:
        """Nothing saved through the hooks is alive, waiting to be released, or being copied."""
        return self.engine.idle and self.recompute.idle

    def release(self) -> None:
        """Release what autograd let go of (kept, swapped and recomputed storages)."""
        self.engine.drain()
        self.recompute.drain()

    # ------------------------------------------------------------------ what the statistics read
    @contextmanager
    def settled(self) -> Iterator[None]:
        """One consistent reading: under the engine's lock, after releasing what autograd let go of and
        finishing the copies that completed."""
        with self.engine.lock:
            self.release()
            self.engine.poll()
            yield

    @property
    def copies(self) -> CopyEngine:
        return self.engine.copies

    @property
    def recompute_s(self) -> float:
        return self.recompute.recompute_s

    def pool(self) -> HostPool | None:
        """The host pool, if one was made (a pool is made at the first swap)."""
        return self.engine.pool if self.engine.has_pool else None

    def copied(self, layer: int) -> tuple[int, int]:
        """Bytes of ``layer`` copied to the host and back so far."""
        return self.engine.layer_d2h.get(layer, 0), self.swap_in.layer_h2d.get(layer, 0)

    def counters(self) -> SavedCounters:
        swap_in, recompute = self.swap_in, self.recompute
        return SavedCounters(
            recompute_s=self.recompute_s, sync_fallbacks=swap_in.sync_fallbacks,
                             prefetched=swap_in.prefetched,
            live_saved_storages=self.engine.live_entries(),
                             multi_phase_storages=self.engine.multi_phase_entries,
            h2d_bytes_by_phase=dict(swap_in.h2d_by_phase), refetched_bytes=swap_in.refetched_bytes,
            repeat_recomputes=recompute.repeat_recomputes, lag_dropped=swap_in.dropped + recompute.dropped)
