"""GPU-only behaviour of the swap path: pinned pool, copy streams, overlap (skipped without CUDA)."""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch
from torch import nn

from vpipe.plan import Policy
from vpipe.tensor_manager import TensorManager
from vpipe.tensor_manager.copy_engine import make_copy_engine
from vpipe.tensor_manager.pool import HostPool
from vpipe_lab.runtime.models import build_model, transformer_lm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DEVICE = torch.device("cuda", 0)


def _manager(model: nn.Sequential, policy: Policy, **kwargs) -> TensorManager:
    layers = {int(n): c for n, c in model.named_children()}
    return TensorManager(layers, device=DEVICE, policies=dict.fromkeys(layers, policy), **kwargs)


def _gpipe_step(model, manager, inputs, loss_fn, garbage: bool = False):
    losses = []
    for mb, x in enumerate(inputs):
        with manager.micro_batch(mb):
            out = model(x)
        losses.append(loss_fn(out))
        if garbage:  # reuse freed blocks on the compute stream while swap-outs may still run
            for _ in range(8):
                torch.full((1 << 20,), float(mb), device=DEVICE).mul_(2.0)
    for mb, loss in enumerate(losses):
        with manager.backward(mb):
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_pool_is_pinned_and_faster_than_pageable_copies():
    engine = make_copy_engine(DEVICE)
    pool = HostPool(256 << 20, pinned=engine.pinned, chunk_bytes=128 << 20)
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device=DEVICE)
    block = pool.alloc(src.numel())
    assert block.data.is_pinned()

    def pooled() -> None:
        engine.to_host(src, block.data).wait()

    def pageable() -> None:
        src.cpu()
        torch.cuda.synchronize()

    times = {"pool": [], "pageable": []}
    for _ in range(7):
        for name, fn in (("pool", pooled), ("pageable", pageable)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    assert statistics.median(times["pool"]) < statistics.median(times["pageable"])
    assert torch.equal(block.data, src.cpu())


@pytest.mark.parametrize("prefetch_alloc", ["copy", "compute"])
def test_no_corruption_when_freed_memory_is_reused_during_copies(prefetch_alloc):
    # "compute": prefetched copies come from the memory the compute stream frees into, which its queued
    # kernels (the garbage below) may still use when the prefetch is issued
    spec = transformer_lm(n_blocks=4, d_model=256, n_heads=4, seq_len=128, dropout=0.1)
    x, y = spec.batch(0, 32, 0)
    inputs = [t.to(DEVICE) for t in x.tensor_split(4)]
    targets = [t.to(DEVICE) for t in y.tensor_split(4)]
    results = {}
    for policy in (Policy.KEEP, Policy.SWAP, Policy.RECOMPUTE):
        model = build_model(spec, seed=0).to(DEVICE)
        manager = _manager(model, policy, min_swap_bytes=0, prefetch_alloc=prefetch_alloc)
        torch.manual_seed(0)
        steps = []
        for _ in range(3):
            it = iter(targets)
            steps.append(_gpipe_step(model, manager, inputs, lambda out, it=it: spec.loss_fn()(out, next(it)),
                                     garbage=True))
        results[policy] = steps
        stats = manager.stats()
        assert stats.live_saved_storages == 0 and stats.host_pool_used_bytes == 0
        if policy is Policy.SWAP:
            assert stats.d2h_bytes > 0 and stats.prefetched > 0
            assert manager._copies.prefetch_alloc == prefetch_alloc  # type: ignore[attr-defined]
    for policy in (Policy.SWAP, Policy.RECOMPUTE):
        for want, got in zip(results[Policy.KEEP], results[policy]):
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"{policy}: {name}")


def test_all_swapped_step_time_within_10_percent_when_copies_fit_the_window():
    """Compute-heavy layers (big matmuls, small saved activations): the copies hide behind compute."""
    torch.manual_seed(0)
    width = 8192  # per layer ~4 ms of fp32 matmuls forward+backward against ~2 ms of copies
    template = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
                               for _ in range(4)])
    inputs = [torch.randn(256, width, device=DEVICE) for _ in range(4)]
    runs = {}
    for policy in (Policy.KEEP, Policy.SWAP):
        model = copy.deepcopy(template).to(DEVICE)
        runs[policy] = (model, _manager(model, policy))
    times = {p: [] for p in runs}
    for r in range(12):
        for policy in (runs if r % 2 == 0 else reversed(list(runs))):
            model, manager = runs[policy]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _gpipe_step(model, manager, inputs, lambda out: out.float().pow(2).mean())
            torch.cuda.synchronize()
            times[policy].append(time.perf_counter() - t0)
    keep, swap = (statistics.median(times[p][2:]) for p in (Policy.KEEP, Policy.SWAP))
    stats = runs[Policy.SWAP][1].stats()
    assert stats.d2h_bytes > 0 and stats.sync_fallbacks == 0
    assert swap <= 1.10 * keep, f"all-S {swap * 1e3:.1f} ms vs all-D {keep * 1e3:.1f} ms"


def test_budget_on_gpu_keeps_the_peak_and_the_gradients():
    spec = transformer_lm(n_blocks=4, d_model=256, n_heads=4, seq_len=128, dropout=0.0)
    x, y = spec.batch(0, 32, 0)
    inputs = [t.to(DEVICE) for t in x.tensor_split(4)]
    targets = [t.to(DEVICE) for t in y.tensor_split(4)]
    model = build_model(spec, seed=0).to(DEVICE)
    kept = _manager(model, Policy.KEEP)
    it = iter(targets)
    want = _gpipe_step(model, kept, inputs, lambda out: spec.loss_fn()(out, next(it)))
    peak = kept.stats().peak_resident_bytes
    kept.close()
    budgeted = _manager(model, Policy.KEEP, budget_bytes=int(0.4 * peak))
    it = iter(targets)
    got = _gpipe_step(model, budgeted, inputs, lambda out: spec.loss_fn()(out, next(it)))
    assert budgeted.stats().peak_resident_bytes <= int(0.4 * peak)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_a_batch_twice_what_the_memory_holds_trains_under_the_budget_with_the_same_gradients():
    """The memory benchmark's claim as behaviour: capped so that plain holds half the
    batch (twice it runs out of memory), the budgeted manager trains the whole batch
    within the cap, with the gradients of an uncapped plain run."""
    spec = transformer_lm(n_blocks=4, d_model=512, n_heads=8, seq_len=256, dropout=0.0)
    x, y = spec.batch(0, 8 * 8, 0)
    inputs = [t.to(DEVICE) for t in x.tensor_split(8)]
    targets = [t.to(DEVICE) for t in y.tensor_split(8)]
    model = build_model(spec, seed=0).to(DEVICE)

    def plain_step(n):
        losses = [spec.loss_fn()(model(inputs[mb]), targets[mb]) / 8 for mb in range(n)]
        for loss in losses:
            loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    want = plain_step(8)
    torch.cuda.reset_peak_memory_stats()
    plain_step(4)
    half = torch.cuda.max_memory_allocated()
    kept = _manager(model, Policy.KEEP)
    it = iter(targets)
    _gpipe_step(model, kept, inputs[:1], lambda out: spec.loss_fn()(out, next(it)) / 8)
    per_mb = kept.stats().peak_resident_bytes
    kept.close()
    want_bytes = {name: g.numel() * g.element_size() for name, g in want.items()}
    del kept
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(DEVICE).total_memory
    torch.cuda.set_per_process_memory_fraction((half + sum(want_bytes.values()) + (256 << 20)) / total,
                                               DEVICE)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            plain_step(8)
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        budgeted = _manager(model, Policy.KEEP, budget_bytes=4 * per_mb)
        it = iter(targets)
        got = _gpipe_step(model, budgeted, inputs, lambda out: spec.loss_fn()(out, next(it)) / 8)
        stats = budgeted.stats()
        budgeted.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, DEVICE)
    assert any(p is not Policy.KEEP for p in stats.policies.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
