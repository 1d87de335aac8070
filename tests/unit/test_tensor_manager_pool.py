"""The host pool: chunks, first-fit ranges freed in any order, a clear error when it is full."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support.tensor_manager import make_manager, model_spec
from vpipe.tensor_manager import HostPoolFullError
from vpipe.tensor_manager.pool import ALIGNMENT, HostPool, default_host_pool_bytes
from vpipe_lab.runtime.models import build_model


def test_ranges_are_reused_and_coalesced():
    pool = HostPool(4096, pinned=False, chunk_bytes=4096)
    a, b, c = pool.alloc(1000), pool.alloc(1000), pool.alloc(1000)
    assert pool.chunks == 1 and pool.used_bytes == 3 * 1024
    a.data.fill_(1)
    c.data.fill_(3)
    pool.free(b)
    pool.free(a)  # a and b merge into one 2048-byte range
    d = pool.alloc(2000)
    assert (d.chunk, d.offset) == (0, 0)
    assert torch.all(c.data == 3)  # untouched by the reuse
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(b)


def test_grows_in_chunks_up_to_its_maximum_then_names_capacity_and_request():
    pool = HostPool(3 * 1024, pinned=False, chunk_bytes=1024)
    blocks = [pool.alloc(1000) for _ in range(3)]
    assert pool.chunks == 3 and pool.capacity_bytes == 3 * 1024
    with pytest.raises(HostPoolFullError,
                       match=r"a swap of 1000 B does not fit; 3\.0 KiB of the pool's maximum "
                                                r"3\.0 KiB are in use \(3 chunks, 3\.0 KiB allocated\)"):
        pool.alloc(1000)
    pool.free(blocks[1])
    assert pool.alloc(1000).chunk == 1  # freed space is found again
    big = HostPool(8192, pinned=False, chunk_bytes=1024)
    block = big.alloc(5000)  # a request larger than a chunk gets a chunk of its own size
    assert big.chunks == 1 and block.data.numel() == 5000


def test_default_size_is_a_fraction_of_available_memory():
    assert default_host_pool_bytes(0.1) > 0
    with pytest.raises(ValueError, match="fraction"):
        default_host_pool_bytes(0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), min_size=1, max_size=60))
def test_live_ranges_never_overlap_and_usage_adds_up(ops):
    pool = HostPool(64 * 1024, pinned=False, chunk_bytes=8 * 1024)
    live = []
    for alloc, size in ops:
        if alloc or not live:
            try:
                live.append(pool.alloc(size))
            except HostPoolFullError:
                continue
        else:
            pool.free(live.pop(size % len(live)))
        spans = sorted((b.chunk, b.offset, b.offset + b.size) for b in live)
        for (c1, _, end1), (c2, start2, _) in zip(spans, spans[1:]):
            assert c1 != c2 or end1 <= start2
        assert pool.used_bytes == sum(b.size for b in live)
        assert all(b.offset % ALIGNMENT == 0 and b.size >= b.nbytes for b in live)
    for b in live:
        pool.free(b)
    assert pool.used_bytes == 0
    chunks = pool.chunks
    whole = [pool.alloc(pool.chunk_bytes) for _ in range(chunks)]  # every range freed came back together
    assert pool.chunks == chunks and sorted((b.chunk, b.offset) for b in whole) == [(i, 0)
                                                                                    for i in range(chunks)]


def test_a_freed_range_goes_to_the_next_request_of_its_size_and_back_to_the_chunk_when_needed():
    pool = HostPool(4096, pinned=False, chunk_bytes=4096)
    a, b = pool.alloc(1000), pool.alloc(1500)
    pool.free(a)
    again = pool.alloc(1000)  # the same size: the range kept aside, no search
    assert (again.chunk, again.offset) == (a.chunk, a.offset) and again.data.data_ptr() == a.data.data_ptr()
    assert pool.used_bytes == 1024 + 1536
    pool.free(again)
    pool.free(b)
    assert pool.used_bytes == 0
    whole = pool.alloc(4096)  # another size that needs the whole chunk: the kept ranges coalesce first
    assert (whole.chunk, whole.offset, pool.chunks) == (0, 0, 1)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a)


def test_a_manager_whose_pool_is_full_says_so():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, {lid: "S" for lid in range(5)}, host_pool_bytes=64 * 1024,
                           host_pool_chunk_bytes=64 * 1024)
    x, _ = spec.batch(0, 2, 0)
    with pytest.raises(HostPoolFullError,
                       match=r"host pool full: a swap of .* of the pool's maximum 64\.0 KiB"):
        with manager.micro_batch(0):
            model(x)
    # the failed forward left no saved-tensor hooks behind, and the manager keeps working
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    manager.set_policies({lid: "D" for lid in range(5)})
    with manager.micro_batch(1):
        model(x)
    assert manager.stats().layers[4].activation_bytes[1] > 0
