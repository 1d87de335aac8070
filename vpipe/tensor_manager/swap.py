"""Saved-tensor storage, pack side: keep a storage on the device, or swap it out to the host pool.

The pack hook hands every managed storage here (:meth:`SwapEngine.keep` or
:meth:`SwapEngine.swap_out`); both return a handle on the storage's entry (:mod:`.handles`),
so a storage saved several times is counted and copied once. Swap-outs are batched per
layer and the device bytes stay held (and counted) until their copy has read them.

Lifetimes follow autograd, not the schedule: an entry is released (its bytes uncounted,
its host block freed) when the last handle that refers to it is destroyed, which autograd
does after the last backward that needs it. Handle destructors only queue the entry; the
queue is drained under a lock at the next safe point (a pack, an unpack, a context
boundary, a stats read). Bringing storages back is :mod:`.swap_in`'s job.

Autograd may keep handles longer than any backward needs them: a split backward's input
pass runs with ``retain_graph``, so the nodes only it runs (an activation's saved output,
attention's internals) keep what they saved for as long as the graph lives, and the graph
lives as long as anything refers to it. torch's last stage detaches its outputs after their
backward so that it dies, but an output that is a view (``nn.Linear`` on a 3-d input, a
Hugging Face LM head's logits) cannot be detached in place, and the stage's
``output_chunks`` (and the output ``step()`` returned) keep the whole graph until the next
step. Once a micro-batch's backward is over (its weight pass ended, or the step did), the
manager *retires* what it still holds (:meth:`SwapEngine.retire`): released as if its last
handle had died; the handles left behind are inert (a swapped one refuses to be unpacked).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from vpipe import timeline
from vpipe.compat.torch_internals import storage_weak_ref, view_base
from vpipe.tensor_manager.accounting import Ledger
from vpipe.tensor_manager.copy_engine import CopyEngine, Ticket
from vpipe.tensor_manager.handles import KeptHandle, StorageEntry, SwappedEntry, SwappedHandle
from vpipe.tensor_manager.pool import HostPool, HostPoolFullError, PoolBlock

__all__ = ["SwapEngine", "flat_bytes", "dense_source"]


# Swap-outs wait for the end of their layer's forward and go as one batch of copies (a stream switch
# and an event pair per batch, not per tensor), unless this many bytes are waiting already: a batch's
# device bytes stay held until its copy ran, and past a few MiB the copy time dwarfs the per-call cost.
DEFAULT_BATCH_BYTES = 8 << 20


E = TypeVar("E", bound=StorageEntry)


def flat_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def dense_source(t: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """A tensor of ``t``'s dtype over exactly its storage's ``nbytes``,
    to copy the storage as (None: as bytes).

    The tensor whose storage it is, when it spans it (an output, a mask; q, k and v through their qkv
    output), with its graph (it is only copied, under ``no_grad``, and let go once the copy ran: a
    ``detach`` here is one more tensor operation per swapped storage), else one flat tensor over the
    storage. None for a lazily conjugated or negated tensor (a copy would write what it reads, not the
    storage's bytes) and for a storage no whole number of elements fills.
    """
    if t.is_conj() or t.is_neg():
        return None
    if t.nbytes == nbytes and t.storage_offset() == 0 and t.is_contiguous():
        return t  # (a view too: its handle then gets the copy itself back)
    whole = view_base(t)
    if whole is not None and not (whole.is_conj() or whole.is_neg()) and whole.nbytes == nbytes \
            and whole.storage_offset() == 0 and whole.is_contiguous():
        return whole
    if nbytes % t.element_size():
        return None
    return (t.detach() if t.requires_grad else t).as_strided((nbytes // t.element_size(),), (1,), 0)


class SwapEngine:
    """Keeps, swaps out and releases saved storages; feeds the
    ledger (:class:`.swap_in.SwapIn` brings them back)."""

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
        self.swapped_bytes: dict[int, int] = {}  # mb -> bytes of those entries (wherever their bytes are now)
        self._live: dict[tuple[int, int], dict[int, StorageEntry]] = {}  # (layer, mb) -> seq -> live entry
        self._unissued: list[SwappedEntry] = []  # packed, copy not issued yet (see flush_swap_outs)
        self._unissued_bytes = 0
        self._swapping_out: deque[tuple[Ticket, list[SwappedEntry]]] = deque()  # issued batches, in order
        self._deferred: deque[tuple[Ticket, PoolBlock | None, object]] = deque()
        self._seq = 0
        self.multi_phase_entries = 0  # released after being unpacked in more than one backward phase
        self.layer_d2h: dict[int, int] = {}

    @property
    def idle(self) -> bool:
        """Nothing saved through the hooks is alive, waiting to be released, or being copied."""
        return not (self._live or self.dead or self._unissued or self._swapping_out or self._deferred)

    @property
    def entries_made(self) -> int:
        """How many storage entries were made so far (each entry's ``seq`` is its number)."""
        return self._seq

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
        if isinstance(entry, SwappedEntry) and entry.source is None and entry.storage_died():
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
            if entry is not None and not isinstance(entry, SwappedEntry):
                entry.refs += 1  # already kept on the device by another save: copying frees nothing
                return KeptHandle(t, entry, self.dead)
            if entry is None:
                entry = self._swap_out_new(t, storage, layer, mb, key, nbytes)
            elif mb not in entry.users:  # another micro-batch saved the same storage: prefetch it for both
                entry.users.append(mb)
                self._swapped.setdefault(mb, {})[entry.seq] = entry
                self.swapped_bytes[mb] = self.swapped_bytes.get(mb, 0) + nbytes
            entry.refs += 1
            entry.unseen += 1
            return SwappedHandle(t, entry, self.dead, copied=entry.source is t)

    def _swap_out_new(self, t: torch.Tensor, storage: torch.UntypedStorage, layer: int, mb: int, key: int,
                      nbytes: int) -> SwappedEntry:
        try:
            block = self.pool.alloc(nbytes)
        except HostPoolFullError as e:
            raise HostPoolFullError(f"layer {layer}, micro-batch {mb}: {e}") from None
        entry = self._new_entry(SwappedEntry, key, layer, mb, nbytes)
        entry.host = block
        entry.weak = storage_weak_ref(storage)
        # the device bytes stay held (and counted) until the copy has read them; the copy
        # itself is issued with the rest of the layer's at flush_swap_outs()
        source = dense_source(t, nbytes)
        if source is None:
            entry.source, entry.host_view = flat_bytes(storage, self.device), block.data
        else:  # no byte view on either side: two tensor ops each way, more than the rest of a small swap
            whole = (source.dtype, source.size(), source.stride())
            entry.source, entry.whole, entry.host_view = source, whole, block.view(whole)
        entry.counted = True
        self.ledger.add(layer, mb, nbytes)
        self._unissued.append(entry)
        self._unissued_bytes += nbytes
        self._swapped.setdefault(mb, {})[entry.seq] = entry
        self.swapped_bytes[mb] = self.swapped_bytes.get(mb, 0) + nbytes
        self.layer_d2h[layer] = self.layer_d2h.get(layer, 0) + nbytes
        if self._unissued_bytes >= self.batch_bytes:
            self.flush_swap_outs()
        return entry

    def flush_swap_outs(self) -> None:
        """Issue the swap-out copies packed since the last flush, as
        one batch (after each layer's forward)."""
        with self.lock:
            if not self._unissued:
                return
            # source and host_view are both set when an entry is
            # packed; only a release (filtered out) clears them
            batch = [e for e in self._unissued if not e.released]
            self._unissued = []
            self._unissued_bytes = 0
            if not batch:
                return
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = [
                (e.source, e.host_view) for e in batch]  # type: ignore[misc]
            with timeline.span("vpipe.swap_out", timeline.MEMORY, tensors=len(pairs),
                               bytes=sum(e.nbytes for e in batch)), torch.no_grad():
                ticket = self.copies.to_host_batch(pairs)
            for entry in batch:
                entry.d2h = ticket
            self._swapping_out.append((ticket, batch))
            if ticket.finished:  # a synchronous copy (CPU): the device bytes can go now
                self.poll()

    def _new_entry(self, kind: type[E], key: int, layer: int, mb: int, nbytes: int) -> E:
        self._seq += 1
        entry = kind(key, layer, mb, nbytes, self._seq)
        self._by_key[key] = entry
        live, call = self._live, (layer, mb)
        entries = live.get(call)
        if entries is None:
            entries = live[call] = {}
        entries[entry.seq] = entry
        return entry

    # ------------------------------------------------------------------ release
    def drain(self) -> bool:
        """Release the entries whose last handle died; True if any was released."""
        released = False
        entry: StorageEntry
        dead = self.dead
        with self.lock:
            while dead:
                item = dead.popleft()
                if isinstance(item, tuple):  # a swapped handle: what it still expected
                    entry, unpacked, later = item
                    if not unpacked:
                        entry.unseen -= 1
                    if later:
                        entry.later -= 1
                else:
                    entry = item
                entry.refs -= 1
                if entry.refs == 0 and not entry.released:  # (a retired entry was released already)
                    self._release(entry)
                    released = True
        return released

    def retire(self, mb: int | None = None) -> int:
        """Release what ``mb`` (None: every micro-batch) still holds once its backward is over; returns how
        many entries. Autograd may still hold handles on them (in a graph that outlives the backward, see
        the module docstring): those are inert from now on. A swapped storage a handle still expects (one
        never unpacked: another micro-batch's too, or one an input pass flagged for a weight pass that did
        not come) stays until the step ends (``mb`` None)."""
        with self.lock:
            self.drain()
            if mb is None:
                entries = [e for by_seq in self._live.values() for e in by_seq.values()]
            else:
                entries = [e for (_, owner), by_seq in self._live.items() if owner == mb
                           for e in by_seq.values()
                           if not (isinstance(e, SwappedEntry) and (e.unseen or e.later))]
                entries += [e for e in self._swapped.get(mb, {}).values()
                            if e.mb != mb and not (e.unseen or e.later)]  # others' storages it used
            for entry in entries:
                self._release(entry)
        return len(entries)

    def _release(self, entry: StorageEntry) -> None:
        entry.released = True
        by_key = self._by_key
        if by_key.get(entry.key) is entry:
            del by_key[entry.key]
        live = self._live
        key = (entry.layer, entry.mb)
        entries = live[key]
        del entries[entry.seq]
        if not entries:
            del live[key]
        if entry.counted:
            entry.counted = False
            self.ledger.sub(entry.layer, entry.mb, entry.nbytes)
        if not isinstance(entry, SwappedEntry):
            return
        entry.forget_storage()
        for mb in entry.users:
            by_mb = self._swapped.get(mb)
            if by_mb is not None and by_mb.pop(entry.seq, None) is not None:
                self.swapped_bytes[mb] -= entry.nbytes
                if not by_mb:
                    del self._swapped[mb], self.swapped_bytes[mb]
        if entry.phases > 1:
            self.multi_phase_entries += 1
        # a copy still using the block (and the device bytes), the later one first: free both once it ended
        pending = entry.h2d
        if pending is None or pending.done():
            pending = entry.d2h
        if pending is not None and not pending.done():
            self._deferred.append((pending, entry.host, (entry.source, entry.device_copy)))
        elif entry.host is not None:
            self.pool.free(entry.host)
        entry.host = entry.host_view = entry.source = entry.device_copy = None

    def outgoing_bytes(self) -> int:
        """Device bytes still counted resident only because their copy to the host has not finished.

        They leave by themselves: the budget's projection counts them as gone, so a copy running
        late costs a wait at pack time (:meth:`wait_swap_outs`), not a lasting change of policy.
        """
        with self.lock:
            issued = (e for _, batch in self._swapping_out for e in batch)
            return sum(e.nbytes for queue in (self._unissued, issued) for e in queue
                       if e.counted and not e.released and e.source is not None and e.device_copy is None)

    @property
    def swap_outs_in_flight(self) -> bool:
        """Whether a swap-out still has to be issued or to finish (never after a flush on CPU)."""
        return bool(self._unissued or self._swapping_out)

    @property
    def copies_in_flight(self) -> bool:
        """Whether a swap-out or a deferred free waits for a copy (never on CPU)."""
        return bool(self._swapping_out or self._deferred)

    def poll(self) -> None:
        """Finish what completed copies allow: drop swapped-out device bytes, free deferred blocks."""
        with self.lock:
            swapping_out = self._swapping_out
            while swapping_out and swapping_out[0][0].done():
                self._finish_swap_outs(swapping_out.popleft()[1])
            while self._deferred and self._deferred[0][0].done():
                _, block, _ = self._deferred.popleft()
                if block is not None:
                    self.pool.free(block)
            self.copies.resolve_timings()

    def _finish_swap_outs(self, batch: list[SwappedEntry]) -> None:
        """A batch's copy to the host ended: its device bytes go (those not brought back meanwhile)."""
        gone = []
        for entry in batch:
            if entry.released or entry.source is None:
                continue
            entry.source = None
            if entry.device_copy is None and entry.counted:
                entry.counted = False
                gone.append(entry)
        self.ledger.sub_each(gone)  # (one ledger update per layer, not per storage)

    def wait_swap_outs(self, until_resident: int) -> None:
        """Block until in-flight swap-outs have released enough device bytes (budget pressure)."""
        with self.lock:
            self.flush_swap_outs()
            while self._swapping_out and self.ledger.resident > until_resident:
                ticket, batch = self._swapping_out.popleft()
                ticket.wait()
                self._finish_swap_outs(batch)

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
            return {mb: len(entries) for (lid, mb), entries in self._live.items() if lid == layer}

    def live_entries(self) -> int:
        with self.lock:
            self.drain()
            return sum(len(entries) for entries in self._live.values())

    def swapped_micro_batches(self) -> list[int]:
        return list(self._swapped)

    def swapped_of(self, mb: int) -> Iterable[SwappedEntry]:
        """The live swapped entries ``mb`` has handles on, in the order they were saved."""
        return self._swapped.get(mb, {}).values()

    def defer(self, ticket: Ticket, block: PoolBlock | None, keep: object) -> None:
        """Hold ``keep`` (and free ``block``) until the copy of ``ticket`` ended."""
        self._deferred.append((ticket, block, keep))
