"""Saved-tensor storage: kept on the device, or swapped to the host pool and brought back.

Autograd's pack hook returns a *handle* per saved tensor; several handles may share one
*entry*, the bookkeeping of one storage (``q``, ``k`` and ``v`` are views of one ``qkv``
storage; a dropout output is saved by the next op too): a storage saved several times is
copied to the host once, and its bytes are counted once.

Lifetimes follow autograd, not the schedule: an entry is released when the last handle
that refers to it is destroyed, which autograd does after the last backward that needs
it. A device copy brought back for a backward is dropped as soon as no live handle of its
entry expects another unpack:

* in a plain backward (phase ``"full"``) once every handle was unpacked in that autograd
  pass; a second ``retain_graph`` pass fetches again;
* a zero-bubble backward unpacks twice, input gradients (phase ``"input"``, with
  ``retain_graph``) then, possibly much later, weight gradients (phase ``"weight"``, one
  autograd pass per parameter group). The manager tells :meth:`SwapEngine.restore`, for
  each unpack of the input pass, whether the unpacking autograd node runs again in the
  weight pass (measured on torch 2.13: the inputs of Linear layers, LayerNorm's input,
  mean and rstd; not attention's q, k, v, masks or softmax output, nor activations' saved
  outputs or dropout masks). Such a handle is flagged ``later``: its entry's device copy
  stays until the weight pass unpacked it, so the storage is fetched once. Handles the
  input pass never unpacked (ops on the weights alone) also keep their entry's copy.
  Everything else is dropped after the input pass, and the weight pass's prefetch skips
  entries no live handle expects. A copy dropped anyway (the budget) is fetched again
  when the weight pass needs it, and counted in ``refetched_bytes``.

Handles are destroyed wherever autograd runs (on CUDA, its device thread); their
destructor only queues the entry, and the queue is drained under a lock at the next safe
point (a pack, an unpack, a context boundary, a stats read).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from vpipe.tensor_manager.accounting import Ledger
from vpipe.tensor_manager.copy_engine import CopyEngine, Ticket
from vpipe.tensor_manager.pool import HostPool, HostPoolFullError, PoolBlock

__all__ = ["StorageEntry", "SwappedEntry", "KeptHandle", "SwappedHandle", "SwapEngine"]


# Swap-outs wait for the end of their layer's forward and go as one batch of copies (a stream switch
# and an event pair per batch, not per tensor), unless this many bytes are waiting already: a batch's
# device bytes stay held until its copy ran, and past a few MiB the copy time dwarfs the per-call cost.
DEFAULT_BATCH_BYTES = 8 << 20


class StorageEntry:
    """One saved storage of one (layer, micro-batch), kept on the device."""

    __slots__ = ("key", "layer", "mb", "nbytes", "seq", "refs", "counted", "released")
    swapped = False

    def __init__(self, key: int, layer: int, mb: int, nbytes: int, seq: int) -> None:
        self.key = key
        self.layer = layer
        self.mb = mb
        self.nbytes = nbytes
        self.seq = seq
        self.refs = 0
        self.counted = False  # its bytes are in the ledger's resident total
        self.released = False


class SwappedEntry(StorageEntry):
    """A storage copied to the host pool, and what brings it back."""

    __slots__ = ("source", "host", "d2h", "device_copy", "h2d", "weak", "unpacks", "phases", "last_phase",
                 "task", "task_unpacks", "users", "unseen", "later", "fetches")
    swapped = True

    def __init__(self, key: int, layer: int, mb: int, nbytes: int, seq: int) -> None:
        super().__init__(key, layer, mb, nbytes, seq)
        self.source: torch.Tensor | None = None  # the original device bytes, while a swap-out is in flight
        self.host: PoolBlock | None = None
        self.d2h: Ticket | None = None
        self.device_copy: torch.Tensor | None = None  # brought back for a backward
        self.h2d: Ticket | None = None
        self.weak: StorageWeakRef | None = None
        self.unpacks = 0
        self.phases = 0  # backward phases (the manager's backward() contexts) that unpacked it
        self.last_phase = -1
        self.task = -1  # the autograd graph task of the last unpack, and its unpacks in that task
        self.task_unpacks = 0
        self.users = [mb]  # micro-batches with handles on it (views of one input are shared by several)
        self.unseen = 0  # live handles never unpacked
        self.later = 0  # live handles unpacked in an input pass that the weight pass unpacks again
        self.fetches = 0  # times brought back from the host


E = TypeVar("E", bound=StorageEntry)


class KeptHandle:
    """What the pack hook returns for a tensor that stays on the device."""

    __slots__ = ("tensor", "entry", "_dead")

    def __init__(self, tensor: torch.Tensor, entry: StorageEntry, dead: deque) -> None:
        self.tensor = tensor
        self.entry = entry
        self._dead = dead

    def __del__(self) -> None:
        self._dead.append(self.entry)


class SwappedHandle:
    """What the pack hook returns for a swapped tensor: the view to rebuild on its storage."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "_dead", "unpacked", "later")

    def __init__(self, t: torch.Tensor, entry: SwappedEntry, dead: deque) -> None:
        self.entry = entry
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self._dead = dead
        self.unpacked = False
        self.later = False  # the weight pass will unpack it again (set by an input pass)

    def __del__(self) -> None:
        self._dead.append((self.entry, self.unpacked, self.later))


def flat_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class SwapEngine:
    """Keeps, swaps out, prefetches and releases saved storages; feeds the ledger."""

    def __init__(self, device: torch.device, ledger: Ledger, copies: CopyEngine,
                 make_pool: Callable[[], HostPool], batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.device = device
        self.batch_bytes = batch_bytes
        self.ledger = ledger
        self.copies = copies
        self._make_pool = make_pool
        self._pool: HostPool | None = None
        self.lock = threading.RLock()
        self.dead: deque[StorageEntry | tuple[SwappedEntry, bool, bool]] = deque()
        self._by_key: dict[int, StorageEntry] = {}
        self._swapped: dict[int, dict[int, SwappedEntry]] = {}  # mb -> seq -> live swapped entry
        self._live: dict[tuple[int, int], int] = {}  # (layer, mb) -> live entries
        self._unissued: list[SwappedEntry] = []  # packed, copy not issued yet (see flush_swap_outs)
        self._unissued_bytes = 0
        self._swapping_out: deque[SwappedEntry] = deque()
        self._deferred: deque[tuple[Ticket, PoolBlock | None, object]] = deque()
        self._seq = 0
        self.sync_fallbacks = 0
        self.prefetched = 0
        self.multi_phase_entries = 0  # released after being unpacked in more than one backward phase
        self.layer_d2h: dict[int, int] = {}
        self.layer_h2d: dict[int, int] = {}
        self.h2d_by_phase: dict[str, int] = {}  # bytes brought back, by the backward phase they were for
        self.refetched_bytes = 0  # bytes brought back again for a storage that had been brought back before
        self.dropped = 0  # device copies kept for a weight pass, dropped to stay under the budget
        self.dropped_bytes: dict[int, int] = {}  # layer -> bytes of such copies

    # ------------------------------------------------------------------ pool
    @property
    def pool(self) -> HostPool:
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    @property
    def has_pool(self) -> bool:
        return self._pool is not None

    # ------------------------------------------------------------------ pack side
    def lookup(self, key: int) -> StorageEntry | None:
        entry = self._by_key.get(key)
        if entry is not None and entry.swapped and entry.source is None and entry.weak.expired():  # type: ignore
            # the storage it was saved from died; the address now belongs to another one
            del self._by_key[key]
            return None
        return entry

    def keep(self, t: torch.Tensor, layer: int, mb: int, key: int, nbytes: int) -> KeptHandle:
        with self.lock:
            entry = self.lookup(key)
            if entry is None or entry.swapped:
                entry = self._new_entry(StorageEntry, key, layer, mb, nbytes)
                entry.counted = True
                self.ledger.add(layer, mb, nbytes)
            entry.refs += 1
            return KeptHandle(t, entry, self.dead)

    def swap_out(self, t: torch.Tensor, storage: torch.UntypedStorage, layer: int, mb: int,
                 key: int, nbytes: int) -> KeptHandle | SwappedHandle:
        with self.lock:
            entry = self.lookup(key)
            if entry is not None and not entry.swapped:
                entry.refs += 1  # already kept on the device by another save: copying frees nothing
                return KeptHandle(t, entry, self.dead)
            if entry is None:
                try:
                    block = self.pool.alloc(nbytes)
                except HostPoolFullError as e:
                    raise HostPoolFullError(f"layer {layer}, micro-batch {mb}: {e}") from None
                entry = self._new_entry(SwappedEntry, key, layer, mb, nbytes)
                entry.host = block
                entry.weak = StorageWeakRef(storage)
                # the device bytes stay held (and counted) until the copy has read them; the copy
                # itself is issued with the rest of the layer's at flush_swap_outs()
                entry.source = flat_bytes(storage, self.device)
                entry.counted = True
                self.ledger.add(layer, mb, nbytes)
                self._unissued.append(entry)
                self._unissued_bytes += nbytes
                self._swapped.setdefault(mb, {})[entry.seq] = entry
                self.layer_d2h[layer] = self.layer_d2h.get(layer, 0) + nbytes
                if self._unissued_bytes >= self.batch_bytes:
                    self.flush_swap_outs()
            elif mb not in entry.users:  # another micro-batch saved the same storage: prefetch it for both
                entry.users.append(mb)
                self._swapped.setdefault(mb, {})[entry.seq] = entry
            entry.refs += 1
            entry.unseen += 1
            return SwappedHandle(t, entry, self.dead)

    def flush_swap_outs(self) -> None:
        """Issue the swap-out copies packed since the last flush, as one batch (after each layer's forward)."""
        with self.lock:
            batch = [e for e in self._unissued if not e.released]
            self._unissued.clear()
            self._unissued_bytes = 0
            if not batch:
                return
            ticket = self.copies.to_host_batch([(e.source, e.host.data) for e in batch])  # type: ignore[union-attr]
            for entry in batch:
                entry.d2h = ticket
                self._swapping_out.append(entry)
            if ticket.done():  # a synchronous copy (CPU): the device bytes can go now
                self.poll()

    def _new_entry(self, kind: type[E], key: int, layer: int, mb: int, nbytes: int) -> E:
        self._seq += 1
        entry = kind(key, layer, mb, nbytes, self._seq)
        self._by_key[key] = entry
        self._live[(layer, mb)] = self._live.get((layer, mb), 0) + 1
        return entry

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
        with self.lock:
            self.drain()
            entry = handle.entry
            entry.unpacks += 1
            if serial != entry.last_phase:
                entry.last_phase = serial
                entry.phases += 1
            task = torch._C._current_graph_task_id()  # one id per autograd pass
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
            if entry.source is not None:
                base = entry.source
            elif entry.device_copy is not None:
                base = entry.device_copy
                self.copies.consume(base, entry.h2d)  # type: ignore[arg-type]
            else:
                self.sync_fallbacks += 1
                base = self._fetch_now(entry, phase)
            restored = torch.empty(0, dtype=handle.dtype, device=base.device).set_(
                base.untyped_storage(), handle.offset, handle.size, handle.stride
            )
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
        assert entry.host is not None
        copy, ticket = self.copies.to_device_now(entry.host.data)
        self._fetched(entry, copy, ticket, phase)
        return copy

    def _fetched(self, entry: SwappedEntry, copy: torch.Tensor, ticket: Ticket, phase: str) -> None:
        entry.device_copy, entry.h2d = copy, ticket
        entry.counted = True
        self.ledger.add(entry.layer, entry.mb, entry.nbytes)
        self.layer_h2d[entry.layer] = self.layer_h2d.get(entry.layer, 0) + entry.nbytes
        self.h2d_by_phase[phase] = self.h2d_by_phase.get(phase, 0) + entry.nbytes
        entry.fetches += 1
        if entry.fetches > 1:
            self.refetched_bytes += entry.nbytes

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
        return entry.task != torch._C._current_graph_task_id() or entry.task_unpacks < entry.refs

    def host_bytes(self, mb: int, weight_only: bool = False) -> int:
        """Bytes of ``mb`` that are only on the host and its next pass needs (what a prefetch would copy)."""
        return sum(e.nbytes for e in self._swapped.get(mb, {}).values() if self._wanted(e, weight_only))

    def prefetch(self, mb: int, limit_bytes: int | None, phase: str = "full") -> bool:
        """Bring ``mb``'s swapped storages back for its ``phase`` pass, last saved first (backward order).

        A weight pass gets only the storages a live handle still expects (flagged by the
        input pass, or never unpacked). Stops before the resident total would pass
        ``limit_bytes``; returns False if it stopped early (the rest is fetched later, or on demand).
        """
        weight_only = phase == "weight"
        with self.lock:
            self.drain()
            entries = self._swapped.get(mb)
            if not entries:
                return True
            batch: list[SwappedEntry] = []
            complete = True
            resident = self.ledger.resident
            for entry in reversed(list(entries.values())):
                if not self._wanted(entry, weight_only):
                    continue
                if limit_bytes is not None and resident + entry.nbytes > limit_bytes:
                    complete = False
                    break
                resident += entry.nbytes
                batch.append(entry)
            if batch:
                copies, ticket = self.copies.to_device_batch([e.host.data for e in batch],  # type: ignore[union-attr]
                                                             [e.d2h for e in batch if e.d2h is not None])
                for entry, copy in zip(batch, copies):
                    self._fetched(entry, copy, ticket, phase)
                self.prefetched += len(batch)
            return complete

    def end_phase(self, mb: int, phase: str, unpacked: bool = True) -> dict[int, int]:
        """A backward phase of ``mb`` ended: drop the device copies no later pass needs.

        After an input pass a copy stays if a handle was flagged for the weight pass, or if
        a handle was never unpacked while the pass did unpack something (``unpacked``: only
        the weight pass uses it); returns, per layer, the bytes so kept. After any other
        pass every copy goes (a later pass fetches again).
        """
        held: dict[int, int] = {}
        with self.lock:
            self.drain()
            for entry in self._swapped.get(mb, {}).values():
                if entry.device_copy is None:
                    continue
                if phase == "input" and (entry.later > 0 or (unpacked and entry.unseen > 0)):
                    held[entry.layer] = held.get(entry.layer, 0) + entry.nbytes
                    continue
                self._drop_device_copy(entry)
        return held

    def held_bytes(self, mb: int) -> int:
        """Device bytes of copies brought back for ``mb`` that are still here."""
        with self.lock:
            return sum(e.nbytes for e in self._swapped.get(mb, {}).values() if e.device_copy is not None)

    def drop_held(self, mb: int, nbytes: int) -> int:
        """Drop device copies of ``mb`` kept for its weight pass, largest first, until ``nbytes`` are
        freed (the weight pass fetches them again); returns the bytes freed."""
        freed = 0
        with self.lock:
            kept = sorted((e for e in self._swapped.get(mb, {}).values() if e.device_copy is not None),
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
        if entry.h2d is not None and not entry.h2d.done():
            # the copy still reads the host block: the block must not be reused before it ends
            self._deferred.append((entry.h2d, None, entry.device_copy))
        entry.device_copy = None
        entry.h2d = None
        if entry.source is None and entry.counted:
            entry.counted = False
            self.ledger.sub(entry.layer, entry.mb, entry.nbytes)

    # ------------------------------------------------------------------ release
    def drain(self) -> bool:
        """Release the entries whose last handle died; True if any was released."""
        released = False
        with self.lock:
            while self.dead:
                item = self.dead.popleft()
                if item.__class__ is tuple:  # a swapped handle: what it still expected
                    entry, unpacked, later = item
                    if not unpacked:
                        entry.unseen -= 1
                    if later:
                        entry.later -= 1
                else:
                    entry = item
                entry.refs -= 1
                if entry.refs == 0:
                    self._release(entry)
                    released = True
        return released

    def _release(self, entry: StorageEntry) -> None:
        entry.released = True
        if self._by_key.get(entry.key) is entry:
            del self._by_key[entry.key]
        key = (entry.layer, entry.mb)
        left = self._live[key] - 1
        if left:
            self._live[key] = left
        else:
            del self._live[key]
        if entry.counted:
            entry.counted = False
            self.ledger.sub(entry.layer, entry.mb, entry.nbytes)
        if not isinstance(entry, SwappedEntry):
            return
        for mb in entry.users:
            by_mb = self._swapped.get(mb)
            if by_mb is not None:
                by_mb.pop(entry.seq, None)
                if not by_mb:
                    del self._swapped[mb]
        if entry.phases > 1:
            self.multi_phase_entries += 1
        pending = [t for t in (entry.d2h, entry.h2d) if t is not None and not t.done()]
        if pending:
            # a copy still uses the block (and the device bytes): free both once it ended
            self._deferred.append((pending[-1], entry.host, (entry.source, entry.device_copy)))
        elif entry.host is not None:
            self.pool.free(entry.host)
        entry.host = entry.source = entry.device_copy = None

    @property
    def copies_in_flight(self) -> bool:
        """Whether a swap-out or a deferred free waits for a copy (never on CPU)."""
        return bool(self._swapping_out or self._deferred)

    def poll(self) -> None:
        """Finish what completed copies allow: drop swapped-out device bytes, free deferred blocks."""
        with self.lock:
            while self._swapping_out and (self._swapping_out[0].d2h is None or self._swapping_out[0].d2h.done()):
                self._finish_swap_out(self._swapping_out.popleft())
            while self._deferred and self._deferred[0][0].done():
                _, block, _ = self._deferred.popleft()
                if block is not None:
                    self.pool.free(block)
            self.copies.resolve_timings()

    def _finish_swap_out(self, entry: SwappedEntry) -> None:
        if entry.released or entry.source is None:
            return
        entry.source = None
        if entry.device_copy is None and entry.counted:
            entry.counted = False
            self.ledger.sub(entry.layer, entry.mb, entry.nbytes)

    def wait_swap_outs(self, until_resident: int) -> None:
        """Block until in-flight swap-outs have released enough device bytes (budget pressure)."""
        with self.lock:
            self.flush_swap_outs()
            while self._swapping_out and self.ledger.resident > until_resident:
                entry = self._swapping_out.popleft()
                if entry.d2h is not None:
                    entry.d2h.wait()
                self._finish_swap_out(entry)

    def wait_all(self) -> None:
        """Block until every copy in flight ended (tests, close)."""
        with self.lock:
            self.wait_swap_outs(-1)
            while self._deferred:
                ticket, block, _ = self._deferred.popleft()
                ticket.wait()
                if block is not None:
                    self.pool.free(block)
            for entries in self._swapped.values():
                for entry in entries.values():
                    if entry.h2d is not None:
                        entry.h2d.wait()
            self.copies.resolve_timings()

    # ------------------------------------------------------------------ queries
    def live_micro_batches(self, layer: int) -> dict[int, int]:
        """Micro-batches that still hold saved storages of ``layer`` -> how many."""
        with self.lock:
            self.drain()
            return {mb: n for (lid, mb), n in self._live.items() if lid == layer}

    def live_entries(self) -> int:
        with self.lock:
            self.drain()
            return sum(self._live.values())

    def swapped_micro_batches(self) -> list[int]:
        return list(self._swapped)
