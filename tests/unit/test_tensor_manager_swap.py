"""The swap engine on its own: keep, swap out, prefetch, restore and
release saved storages, and count their bytes.

Storages are saved by hand here (no autograd), with the engine's own copy engine on CPU
(synchronous: every ticket is born complete) or with :class:`LateCopies`, whose copies
finish only when the test says so, as a GPU's do when they run on their own streams: what
must wait for a copy (dropping device bytes, freeing host blocks) is then seen waiting.
Split-backward (zero-bubble) phases are not covered here: plain backwards only.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from support.tensor_manager import LateCopies
from vpipe.tensor_manager import TensorManager
from vpipe.tensor_manager.accounting import Ledger
from vpipe.tensor_manager.copy_engine import D2H, H2D, CpuCopyEngine
from vpipe.tensor_manager.pool import HostPool, HostPoolFullError
from vpipe.tensor_manager.swap import KeptHandle, SwapEngine, SwappedHandle
from vpipe.tensor_manager.swap_in import SwapIn

CPU = torch.device("cpu")
KIB = 1024


def make_engine(copies: CpuCopyEngine | None = None, pool_bytes: int = 64 * KIB,
                batch_bytes: int = 1 << 30) -> tuple[SwapEngine, Ledger]:
    ledger = Ledger()
    engine = SwapEngine(CPU, ledger, copies or CpuCopyEngine(CPU),
                        lambda: HostPool(pool_bytes, pinned=False, chunk_bytes=16 * KIB),
                        batch_bytes=batch_bytes)
    return engine, ledger


def keep(engine: SwapEngine, t: torch.Tensor, layer: int = 0, mb: int = 0) -> KeptHandle:
    storage = t.untyped_storage()
    return engine.keep(t, layer, mb, storage.data_ptr(), storage.nbytes())


def swap(engine: SwapEngine, t: torch.Tensor, layer: int = 0, mb: int = 0) -> KeptHandle | SwappedHandle:
    storage = t.untyped_storage()
    return engine.swap_out(t, storage, layer, mb, storage.data_ptr(), storage.nbytes())


_BACK: dict[int, SwapIn] = {}


def back(engine: SwapEngine) -> SwapIn:
    """The side that brings ``engine``'s storages back (one per engine, as a tensor manager holds it)."""
    if id(engine) not in _BACK:
        _BACK[id(engine)] = SwapIn(engine)
    return _BACK[id(engine)]


def end_full_phase(engine: SwapEngine, mb: int) -> None:
    """A plain (not split) backward of ``mb`` ended."""
    back(engine).end_phase(mb, "full")


def kib(n: int) -> torch.Tensor:
    """A float32 tensor of ``n`` KiB with recognisable values."""
    return torch.arange(n * KIB // 4, dtype=torch.float32)


# ---------------------------------------------------------------------- keep
def test_a_kept_storage_is_counted_once_and_released_with_its_last_handle():
    engine, ledger = make_engine()
    x = kib(1)
    first, second = keep(engine, x[:128], layer=3, mb=1), keep(engine, x[128:], layer=3, mb=1)
    assert first.entry is second.entry and first.tensor.data_ptr() == x.data_ptr()
    assert ledger.resident == ledger.peak == KIB and ledger.resident_of(3) == {1: KIB}
    assert engine.live_entries() == 1 and engine.live_micro_batches(3) == {1: 1}
    del first
    assert not engine.drain() and ledger.resident == KIB  # a handle is still alive
    del second
    assert engine.drain()
    assert ledger.resident == 0 and ledger.peak == KIB and engine.live_entries() == 0
    assert engine.live_micro_batches(3) == {} and not engine.has_pool  # keeping never needs the host pool


def test_a_storage_already_kept_is_not_swapped_when_saved_again():
    engine, ledger = make_engine()
    x = kib(2)
    kept = keep(engine, x)
    again = swap(engine, x[10:])
    assert (
        isinstance(again, KeptHandle)
        and again.entry is kept.entry
        and again.tensor.data_ptr() == x[10:].data_ptr()
    )
    engine.flush_swap_outs()
    assert ledger.resident == 2 * KIB and engine.copies.bytes[D2H] == 0 and not engine.has_pool


# ---------------------------------------------------------------------- swap out, restore, release
def test_swapped_bytes_stay_counted_until_their_copy_ran_then_live_on_the_host_only():
    engine, ledger = make_engine()
    x = kib(4).reshape(8, 128)
    handle = swap(engine, x, layer=1, mb=0)
    assert isinstance(handle, SwappedHandle)
    # packed, not copied yet: the layer's copies go as one batch when its forward ends
    assert ledger.resident == 4 * KIB and engine.copies.bytes[D2H] == 0 and engine.pool.used_bytes == 4 * KIB
    engine.flush_swap_outs()
    assert engine.copies.bytes[D2H] == 4 * KIB and engine.layer_d2h == {1: 4 * KIB}
    # a synchronous copy: the device bytes went at once
    assert ledger.resident == 0 and ledger.peak == 4 * KIB
    assert torch.equal(handle.entry.host.data, x.reshape(-1).view(torch.uint8))
    assert back(engine).host_bytes(0) == 4 * KIB and engine.live_micro_batches(1) == {0: 1}

    restored = back(engine).restore(handle)  # no prefetch: copied back on demand
    assert torch.equal(restored,
                       x) and restored.stride() == x.stride() and restored.data_ptr() != x.data_ptr()
    assert back(engine).sync_fallbacks == 1 and engine.copies.bytes[H2D] == 4 * KIB
    assert back(engine).layer_h2d == {1: 4 * KIB}
    assert ledger.resident == 0  # its only handle was unpacked: the node holds the copy, the ledger does not
    del handle
    assert engine.drain()
    assert engine.pool.used_bytes == 0 and engine.live_entries() == 0 and engine.swapped_micro_batches() == []


def test_views_of_one_storage_are_copied_out_once_and_brought_back_once():
    engine, ledger = make_engine()
    qkv = kib(6).reshape(16, 96)
    q, k, v = qkv[:, :32], qkv[:, 32:64], qkv[:, 64:]  # strided views at different offsets
    handles = [swap(engine, t, layer=2, mb=0) for t in (q, k, v)]
    assert len({h.entry for h in handles}) == 1
    engine.flush_swap_outs()
    assert (
        engine.copies.bytes[D2H] == 6 * KIB
        and engine.pool.used_bytes == 6 * KIB
        and engine.live_entries() == 1
    )
    got = [back(engine).restore(h) for h in handles]
    for want, have in zip((q, k, v), got):
        assert torch.equal(have, want) and have.stride() == want.stride()
        assert have.storage_offset() == want.storage_offset()
    # one copy served all three
    assert engine.copies.bytes[H2D] == 6 * KIB and back(engine).sync_fallbacks == 1
    assert ledger.peak == 6 * KIB
    del handles, got
    engine.drain()
    assert engine.pool.used_bytes == 0 and ledger.resident == 0


@pytest.mark.parametrize("case", ["output", "view without a base", "other dtype", "odd-sized storage"])
def test_every_saved_tensor_comes_back_with_its_layout_whichever_way_its_storage_was_copied(case: str):
    """A tensor that spans its storage is copied as it is (its handle gets the copy itself back); a view
    without a base copies its storage as one flat tensor of its dtype; another dtype on the same storage,
    or a storage no whole number of its elements fills, goes as bytes. Each comes back equal, with its
    own strides and offset, and the whole storage crossed once each way."""
    engine, ledger = make_engine()
    if case == "output":
        saved = [kib(4).reshape(32, 32).clone()]
    elif case == "view without a base":  # as autograd's own ops save them: an offset view, no ``_base``
        base = kib(4)
        saved = [torch.empty(0).set_(base.untyped_storage(), 256, (16, 32), (1, 16))]
    elif case == "other dtype":
        x = kib(4)
        saved = [x, x.view(torch.int32)[8:].reshape(127, 8)]
    else:  # 1001 bytes: a float32 view of the first 1000
        raw = torch.zeros(1001, dtype=torch.uint8)
        raw[:1000] = torch.arange(250, dtype=torch.float32).view(torch.uint8)
        saved = [torch.empty(0).set_(raw.untyped_storage(), 0, (250,), (1,))]
    assert all(t._base is None or case == "other dtype" for t in saved)
    handles = [swap(engine, t) for t in saved]
    assert len({h.entry for h in handles}) == 1
    nbytes = saved[0].untyped_storage().nbytes()
    engine.flush_swap_outs()
    assert back(engine).prefetch(0, None)
    copy = handles[0].entry.device_copy
    got = [back(engine).restore(h) for h in handles]
    for want, have in zip(saved, got):
        assert have.dtype == want.dtype and torch.equal(have, want)
        assert have.stride() == want.stride() and have.storage_offset() == want.storage_offset()
    assert engine.copies.bytes[D2H] == engine.copies.bytes[H2D] == nbytes
    # nothing rebuilt for a tensor that spans its storage: the copy is the tensor
    assert [have is copy for have in got] == {"output": [True], "view without a base": [False],
                                              "other dtype": [True, False],
                                              "odd-sized storage": [False]}[case]
    del handles, got
    engine.drain()
    assert engine.pool.used_bytes == 0 and ledger.resident == 0


def test_a_storage_two_micro_batches_saved_is_copied_once_and_prefetched_for_either():
    engine, ledger = make_engine()
    shared = kib(2)
    a = swap(engine, shared, layer=0, mb=0)
    b = swap(engine, shared, layer=0, mb=1)
    own = swap(engine, kib(1), layer=1, mb=1)
    assert a.entry is b.entry and a.entry.users == [0, 1]
    # what the prefetcher bounds a micro-batch's copy time with: its live swapped bytes, shared ones with each
    assert engine.swapped_bytes == {0: 2 * KIB, 1: 3 * KIB}
    del own
    engine.drain()
    assert engine.swapped_bytes == {0: 2 * KIB, 1: 2 * KIB}
    engine.flush_swap_outs()
    assert sorted(engine.swapped_micro_batches()) == [0, 1] and engine.copies.bytes[D2H] == 2 * KIB
    assert back(engine).host_bytes(1) == 2 * KIB
    assert back(engine).prefetch(1, None) and back(engine).prefetched == 1 and ledger.resident == 2 * KIB
    assert back(engine).host_bytes(0) == 0  # one copy on the device serves both micro-batches
    del a
    engine.drain()
    assert engine.pool.used_bytes == 2 * KIB  # micro-batch 1 still holds it
    assert engine.swapped_bytes == {0: 2 * KIB, 1: 2 * KIB}  # (listed for both until the storage is released)
    del b
    engine.drain()
    assert engine.pool.used_bytes == 0 and engine.swapped_micro_batches() == [] and ledger.resident == 0
    assert engine.swapped_bytes == {}


def test_a_full_host_pool_names_the_layer_and_micro_batch_and_counts_nothing():
    engine, ledger = make_engine(pool_bytes=4 * KIB)
    keepalive = swap(engine, kib(3), layer=1, mb=0)
    with pytest.raises(
        HostPoolFullError,
        match=r"^layer 4, micro-batch 2: host pool full: a swap of 2\.0 KiB does "
        r"not fit; 3\.0 KiB of the pool's maximum 4\.0 KiB are in use",
    ):
        swap(engine, kib(2), layer=4, mb=2)
    assert ledger.resident == 3 * KIB and engine.live_entries() == 1 and engine.live_micro_batches(4) == {}
    assert keepalive.entry.layer == 1


def test_an_address_whose_storage_died_is_a_new_storage():
    engine, _ = make_engine()
    x = kib(1)
    handle = swap(engine, x)
    key = x.untyped_storage().data_ptr()
    engine.flush_swap_outs()
    assert engine.lookup(key) is handle.entry
    del x  # the original storage is gone (the engine kept only a weak reference after the copy)
    assert engine.lookup(key) is None
    y = kib(1)  # another storage that (the allocator may) reuse the address: a new entry, its own host block
    other = engine.swap_out(y, y.untyped_storage(), 0, 0, key, y.untyped_storage().nbytes())
    assert other.entry is not handle.entry and engine.pool.used_bytes == 2 * KIB


# ---------------------------------------------------------------------- prefetch and the end of a backward
def _three_swapped(engine: SwapEngine, mbs: Sequence[int] = (0, 0, 0)) -> tuple[list[torch.Tensor], list]:
    tensors = [kib(1) + 1000 * i for i in range(3)]
    handles = [swap(engine, t, layer=i, mb=mb) for i, (t, mb) in enumerate(zip(tensors, mbs))]
    engine.flush_swap_outs()
    return tensors, handles


def test_prefetch_brings_the_last_saved_back_first_and_stops_at_the_limit():
    engine, ledger = make_engine()
    tensors, handles = _three_swapped(engine)
    assert back(engine).host_bytes(0) == 3 * KIB and ledger.resident == 0
    assert back(engine).prefetch(0, KIB - 1) is False and back(engine).prefetched == 0  # not even one fits
    # the last two saved (the backward's first), then the limit
    assert back(engine).prefetch(0, 2 * KIB) is False
    assert [h.entry.device_copy is not None for h in handles] == [False, True, True]
    assert ledger.resident == 2 * KIB and back(engine).prefetched == 2 and back(engine).host_bytes(0) == KIB
    assert back(engine).layer_h2d == {1: KIB, 2: KIB}
    assert (
        back(engine).prefetch(0, None) is True and ledger.resident == 3 * KIB and back(engine).prefetched == 3
    )
    # nothing left to bring back
    assert back(engine).prefetch(0, None) is True and back(engine).prefetched == 3
    for handle, want in zip(reversed(handles), reversed(tensors)):
        assert torch.equal(back(engine).restore(handle), want)
    assert back(engine).sync_fallbacks == 0 and engine.copies.bytes[H2D] == 3 * KIB
    assert back(engine).prefetch(7, None) is True  # a micro-batch with nothing swapped


def test_the_end_of_a_backward_drops_its_micro_batchs_device_copies_only():
    engine, ledger = make_engine()
    tensors, handles = _three_swapped(engine, mbs=(0, 0, 1))
    back(engine).prefetch(0, None)
    back(engine).prefetch(1, None)
    assert ledger.resident == 3 * KIB and ledger.resident_of(2) == {1: KIB}
    end_full_phase(engine, 0)
    assert ledger.resident == KIB and ledger.resident_by_layer() == {2: KIB}
    # the host copies stay with the handles
    assert engine.pool.used_bytes == 3 * KIB and engine.live_entries() == 3
    assert back(engine).host_bytes(0) == 2 * KIB
    assert torch.equal(back(engine).restore(handles[0]), tensors[0])
    assert back(engine).sync_fallbacks == 1  # fetched again
    end_full_phase(engine, 1)
    assert ledger.resident == 0


# ------------------------------------------------------------------- copies still in flight (a GPU's streams)
def test_device_bytes_are_dropped_only_once_their_copy_to_the_host_finished():
    copies = LateCopies()
    engine, ledger = make_engine(copies)
    x = kib(2)
    handle = swap(engine, x)
    engine.flush_swap_outs()
    assert engine.copies_in_flight and ledger.resident == 2 * KIB
    restored = back(engine).restore(handle)  # the original is still here: no copy back at all
    assert restored.data_ptr() == x.data_ptr() and back(engine).sync_fallbacks == 0 and copies.bytes[H2D] == 0
    engine.poll()
    assert ledger.resident == 2 * KIB  # the copy has not run: the bytes are still needed
    copies.complete_all()
    engine.poll()
    assert ledger.resident == 0 and not engine.copies_in_flight
    assert torch.equal(handle.entry.host.data, x.view(torch.uint8))


def test_host_blocks_released_while_a_copy_reads_or_writes_them_are_freed_after_it():
    copies = LateCopies()
    engine, ledger = make_engine(copies)
    out_in_flight = swap(engine, kib(2))
    engine.flush_swap_outs()
    del out_in_flight  # released while its copy to the host is still running
    engine.drain()
    assert ledger.resident == 0 and engine.live_entries() == 0
    assert engine.pool.used_bytes == 2 * KIB and engine.copies_in_flight  # the copy still writes the block
    copies.complete_all()
    engine.poll()
    assert engine.pool.used_bytes == 0 and not engine.copies_in_flight

    back_in_flight = swap(engine, kib(1))
    engine.flush_swap_outs()
    copies.complete_all()
    engine.poll()
    back(engine).prefetch(0, None)  # a copy back to the device, still running when the handle dies
    del back_in_flight
    engine.drain()
    assert engine.pool.used_bytes == KIB and ledger.resident == 0
    copies.complete_all()
    engine.poll()
    assert engine.pool.used_bytes == 0


def test_waiting_for_swap_outs_stops_once_enough_device_bytes_are_free():
    copies = LateCopies()
    engine, ledger = make_engine(copies)
    handles = []
    for i in range(3):  # three layers: three batches of copies
        handles.append(swap(engine, kib(1), layer=i))
        engine.flush_swap_outs()
    assert ledger.resident == 3 * KIB
    engine.wait_swap_outs(until_resident=KIB + KIB // 2)
    assert ledger.resident == KIB  # the two oldest copies were waited for, the third still runs
    assert [h.entry.d2h.done() for h in handles] == [True, True, False]
    engine.wait_all()
    assert ledger.resident == 0 and not engine.copies_in_flight


def test_swap_outs_are_issued_together_unless_the_batch_cap_is_reached():
    engine, ledger = make_engine(batch_bytes=3 * KIB)
    batches: list[int] = []
    inner = engine.copies.to_host_batch
    engine.copies.to_host_batch = lambda pairs: (batches.append(len(pairs)), inner(pairs))[1]  # type: ignore
    keep_alive = [swap(engine, kib(1)), swap(engine, kib(1))]
    assert batches == [] and ledger.resident == 2 * KIB
    keep_alive.append(swap(engine, kib(1)))  # 3 KiB waiting: issued now, not at the end of the layer
    assert batches == [3] and ledger.resident == 0
    keep_alive.append(swap(engine, kib(1)))
    engine.flush_swap_outs()
    engine.flush_swap_outs()  # nothing left: no empty batch
    assert batches == [3, 1]


# ---------------------------------------------------------------------- through autograd
class _ConjugatingBlock(torch.nn.Module):
    """Saves lazily conjugated and negated views: ``x.conj()`` for
    the matmul, ``z.conj().imag`` for the mul."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.complex64,
                                                generator=torch.Generator().manual_seed(seed)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.conj() @ self.w
        return torch.complex(z.conj().imag * z.real, z.imag)


def test_conjugated_and_negated_views_come_back_as_they_read():
    """Such a view reads its storage's bytes conjugated or negated: the bytes cross as they are and the
    view gets its bits back (a copy of the view itself would carry what it reads into its neighbours)."""
    from support.tensor_manager import make_manager

    seen: list[tuple[bool, bool]] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append((t.is_conj(), t.is_neg()))
        return t

    def step(manager) -> dict[str, torch.Tensor]:
        model = torch.nn.Sequential(_ConjugatingBlock(0), _ConjugatingBlock(1))
        if manager is not None:
            manager = make_manager(model, {0: "S", 1: "S"})
        losses = []
        for mb in range(3):
            x = torch.randn(4, 8, dtype=torch.complex64, generator=torch.Generator().manual_seed(mb))
            with manager.micro_batch(mb) if manager is not None else torch.autograd.graph.saved_tensors_hooks(
                    probe, lambda t: t):
                losses.append(model(x).abs().pow(2).sum())
        for mb, loss in enumerate(losses):
            with manager.backward(mb) if manager is not None else torch.autograd.graph.saved_tensors_hooks(
                    lambda t: t, lambda t: t):
                loss.backward()
        if manager is not None:
            assert manager.stats().d2h_bytes > 0 and manager.stats().live_saved_storages == 0
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = step(None)
    assert (True, False) in seen and (False, True) in seen
    got = step(True)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_misspelt_prefetch_allocation_is_refused_when_the_manager_is_made(monkeypatch):
    layers = {0: torch.nn.Linear(4, 4)}
    with pytest.raises(ValueError, match=r"^prefetch_alloc must be one of copy, compute, got 'compte'$"):
        TensorManager(layers, device=torch.device("cpu"), prefetch_alloc="compte")
    for value in ("copy", "compute"):  # (refused before it claimed the module: it may be managed again)
        TensorManager(layers, device=torch.device("cpu"), prefetch_alloc=value).close()
    # the environment is the settings' to read (at attach), not the manager's
    monkeypatch.setenv("VPIPE_PREFETCH_ALLOC", "compte")
    TensorManager(layers, device=torch.device("cpu")).close()
