"""Bringing swapped storages back to the device: on demand, prefetched, held between passes.

The swap engine (:mod:`.swap`) owns the entries; this side decides how long a device copy
brought back for a backward lives. It is dropped as soon as no live handle of its entry
expects another unpack:

* in a plain backward (phase ``"full"``) once every handle was unpacked in that autograd
  pass; a second ``retain_graph`` pass fetches again;
* a zero-bubble backward unpacks twice, input gradients (phase ``"input"``, with
  ``retain_graph``) then, possibly much later, weight gradients (phase ``"weight"``, one
  autograd pass per parameter group). The manager tells :meth:`SwapIn.restore`, for each
  unpack of the input pass, whether the unpacking autograd node runs again in the weight
  pass (measured on torch 2.13: the inputs of Linear layers, LayerNorm's input, mean and
  rstd; not attention's q, k, v, masks or softmax output, nor activations' saved outputs
  or dropout masks). Such a handle is flagged ``later``: its entry's device copy stays
  until the weight pass unpacked it, so the storage is fetched once. Handles the input
  pass never unpacked (ops on the weights alone) also keep their entry's copy. Everything
  else is dropped after the input pass, and the weight pass's prefetch skips entries no
  live handle expects. A copy dropped anyway (the budget) is fetched again when the
  weight pass needs it, and counted in ``refetched_bytes``.
"""

from __future__ import annotations

import torch

from vpipe import timeline
from vpipe.compat.torch_internals import current_graph_task_id, neg_view
from vpipe.tensor_manager.copy_engine import Ticket
from vpipe.tensor_manager.handles import VIEW, WHOLE, SwappedEntry, SwappedHandle
from vpipe.tensor_manager.swap import SwapEngine

__all__ = ["SwapIn"]


class SwapIn:
    """Restores, prefetches and drops the device copies of one swap engine's storages."""

    def __init__(self, engine: SwapEngine) -> None:
        self.engine = engine
        self.ledger = engine.ledger
        self.copies = engine.copies
        self.sync_fallbacks = 0
        self.prefetched = 0
        self.layer_h2d: dict[int, int] = {}
        self.h2d_by_phase: dict[str, int] = {}  # bytes brought back, by the backward phase they were for
        self.refetched_bytes = 0  # bytes brought back again for a storage that had been brought back before
        self.dropped = 0  # device copies kept for a weight pass, dropped to stay under the budget
        self.dropped_bytes: dict[int, int] = {}  # layer -> bytes of such copies

    # ------------------------------------------------------------------ unpack side
    def restore(self, handle: SwappedHandle, phase: str = "full", serial: int = 0, later: bool = False,
                limit_bytes: int | None = None) -> torch.Tensor:
        """The saved tensor, on the device: from the original, a prefetched copy, or a copy made now.

        ``phase`` is the backward phase unpacking it and ``serial`` that phase's number (a
        storage unpacked under two serials counts as multi-phase); ``later``: the weight pass
        will unpack this handle again (only an input pass says so). A copy kept for a weight
        pass while the resident total is above ``limit_bytes`` is dropped once this pass is done
        with it (the handle stays flagged: the weight pass's prefetch brings it back).
        """
        engine = self.engine
        with engine.lock:
            if engine.dead:
                engine.drain()
            entry = handle.entry
            if entry.released:
                raise RuntimeError(
                    f"layer {entry.layer}, micro-batch {entry.mb}: a saved tensor was unpacked after the "
                    "micro-batch's backward ended (its weight pass, or the step); the "
                    f"tensor manager let go of it then. Trying to backward through the graph a second time?")
            if serial != entry.last_phase:
                entry.last_phase = serial
                entry.phases += 1
            task = current_graph_task_id()  # one id per autograd pass
            if task != entry.task:
                entry.task = task
                entry.task_unpacks = 0
            entry.task_unpacks += 1
            if not handle.unpacked:
                handle.unpacked = True
                entry.unseen -= 1
            if handle.later:
                handle.later = False
                entry.later -= 1
            if later:
                handle.later = True
                entry.later += 1
            if entry.source is not None:  # still here: its copy out has not finished
                base = entry.source.detach() if entry.source.requires_grad else entry.source
            elif entry.device_copy is not None:
                base = entry.device_copy
                if entry.consumed is None or not self.copies.consumed_on(entry.consumed):
                    entry.consumed = self.copies.consume(base, entry.h2d)  # type: ignore[arg-type]
            else:
                self.sync_fallbacks += 1
                base = self._fetch_now(entry, phase)
            if handle.layout == WHOLE:
                restored = base  # the saved tensor spans its storage: the copy is the tensor
            elif handle.layout == VIEW:
                restored = base.as_strided(handle.size, handle.stride, handle.offset)
            else:
                restored = torch.empty(0, dtype=handle.dtype, device=base.device).set_(
                    base.untyped_storage(), handle.offset, handle.size, handle.stride
                )
                if handle.conj:
                    restored = restored.conj()
                if handle.neg:
                    restored = neg_view(restored)
            # the node using it holds the storage until it finished; drop the entry's copy once no
            # live handle expects another unpack: in a weight pass the handles the input pass was
            # the last user of are never unpacked, elsewhere every handle is unpacked once per pass
            if entry.unseen == 0 and (phase == "weight" or entry.task_unpacks >= entry.refs):
                if entry.later == 0:
                    self._drop_device_copy(entry)
                elif (phase != "weight" and limit_bytes is not None and entry.device_copy is not None
                      and self.ledger.resident > limit_bytes):
                    self._drop_for_budget(entry)
            return restored

    def _fetch_now(self, entry: SwappedEntry, phase: str) -> torch.Tensor:
        with timeline.span("vpipe.swap_in_now", timeline.MEMORY, mb=entry.mb, layer=entry.layer,
                           bytes=entry.nbytes):
            assert entry.host_view is not None  # (only a release clears it)
            copy, ticket = self.copies.to_device_now(entry.host_view)
        self._fetched(entry, copy, ticket)
        self._count([entry], phase)
        return copy

    def _fetched(self, entry: SwappedEntry, copy: torch.Tensor, ticket: Ticket) -> None:
        """``copy`` (its copy issued under ``ticket``) is ``entry``'s device copy now (the caller counts the
        bytes: :meth:`_count`)."""
        entry.device_copy, entry.h2d, entry.consumed = copy, ticket, None
        entry.counted = True
        entry.fetches += 1
        if entry.fetches > 1:
            self.refetched_bytes += entry.nbytes

    def _count(self, arrived: list[SwappedEntry], phase: str) -> None:
        """Entries brought back for a ``phase`` pass: resident again, and their bytes counted per layer and
        per phase (one update per layer, not per storage)."""
        layer_h2d = self.layer_h2d
        total = 0
        for (layer, _), nbytes in self.ledger.add_each(arrived).items():
            layer_h2d[layer] = layer_h2d.get(layer, 0) + nbytes
            total += nbytes
        self.h2d_by_phase[phase] = self.h2d_by_phase.get(phase, 0) + total

    # ------------------------------------------------------------------ prefetch
    @staticmethod
    def _wanted(entry: SwappedEntry, weight_only: bool) -> bool:
        """Only on the host, and expected again: by a weight pass (a handle flagged for it or never
        unpacked), or by a plain or input pass that has not unpacked every handle yet."""
        if entry.source is not None or entry.device_copy is not None or entry.released:
            return False
        if entry.later > 0 or entry.unseen > 0:
            return True
        if weight_only:
            return False
        return entry.task != current_graph_task_id() or entry.task_unpacks < entry.refs

    def host_bytes(self, mb: int, weight_only: bool = False) -> int:
        """Bytes of ``mb`` that are only on the host and its next pass needs (what a prefetch would copy)."""
        return sum(e.nbytes for e in self.engine.swapped_of(mb) if self._wanted(e, weight_only))

    def prefetch(self, mb: int, limit_bytes: int | None, phase: str = "full") -> bool:
        """Bring ``mb``'s swapped storages back for its ``phase`` pass, last saved first (backward order).

        A weight pass gets only the storages a live handle still expects (flagged by the
        input pass, or never unpacked). Stops before the resident total would pass
        ``limit_bytes``; returns False if it stopped early (the rest is fetched later, or on demand).
        """
        weight_only = phase == "weight"
        engine = self.engine
        with engine.lock:
            engine.drain()
            entries = list(engine.swapped_of(mb))
            if not entries:
                return True
            batch: list[SwappedEntry] = []
            complete = True
            resident = self.ledger.resident
            for entry in reversed(entries):
                if not self._wanted(entry, weight_only):
                    continue
                if limit_bytes is not None and resident + entry.nbytes > limit_bytes:
                    complete = False
                    break
                resident += entry.nbytes
                batch.append(entry)
            if batch:
                nbytes = resident - self.ledger.resident
                with timeline.span("vpipe.prefetch", timeline.MEMORY, mb=mb, phase=phase, tensors=len(batch),
                                   bytes=nbytes):
                    views = [e.host_view for e in batch]
                    copies, ticket = self.copies.to_device_batch(
                        views, [e.d2h for e in batch if e.d2h is not None])  # type: ignore[arg-type]
                for entry, copy in zip(batch, copies):
                    self._fetched(entry, copy, ticket)
                self._count(batch, phase)
                self.prefetched += len(batch)
            return complete

    # ------------------------------------------------------------------ between passes
    def end_phase(self, mb: int, phase: str, unpacked: bool = True) -> dict[int, int]:
        """A backward phase of ``mb`` ended: drop the device copies no later pass needs.

        After an input pass a copy stays if a handle was flagged for the weight pass, or if
        a handle was never unpacked while the pass did unpack something (``unpacked``: only
        the weight pass uses it); returns, per layer, the bytes so kept. After any other
        pass every copy goes (a later pass fetches again).
        """
        held: dict[int, int] = {}
        engine = self.engine
        with engine.lock:
            engine.drain()
            for entry in engine.swapped_of(mb):
                if entry.device_copy is None:
                    continue
                if phase == "input" and (entry.later > 0 or (unpacked and entry.unseen > 0)):
                    held[entry.layer] = held.get(entry.layer, 0) + entry.nbytes
                    continue
                self._drop_device_copy(entry)
        return held

    def held_bytes(self, mb: int) -> int:
        """Device bytes of copies brought back for ``mb`` that are still here."""
        with self.engine.lock:
            return sum(e.nbytes for e in self.engine.swapped_of(mb) if e.device_copy is not None)

    def drop_held(self, mb: int, nbytes: int) -> int:
        """Drop device copies of ``mb`` kept for its weight pass, largest first, until ``nbytes`` are
        freed (the weight pass fetches them again); returns the bytes freed."""
        freed = 0
        with self.engine.lock:
            kept = sorted((e for e in self.engine.swapped_of(mb) if e.device_copy is not None),
                          key=lambda e: -e.nbytes)
            for entry in kept:
                if freed >= nbytes:
                    break
                self._drop_for_budget(entry)
                freed += entry.nbytes
        return freed

    def _drop_for_budget(self, entry: SwappedEntry) -> None:
        """Drop a copy a later pass still needs (it is fetched again then)."""
        self._drop_device_copy(entry)
        self.dropped += 1
        self.dropped_bytes[entry.layer] = self.dropped_bytes.get(entry.layer, 0) + entry.nbytes

    def _drop_device_copy(self, entry: SwappedEntry) -> None:
        if entry.device_copy is None:
            return
        h2d = entry.h2d
        if h2d is not None and not h2d.done():
            # the copy still reads the host block: the block must not be reused before it ends
            self.engine.defer(h2d, None, entry.device_copy)
        entry.device_copy = None
        entry.h2d = None
        if entry.source is None and entry.counted:
            entry.counted = False
            self.ledger.sub(entry.layer, entry.mb, entry.nbytes)
