"""Swaps a micro-batch skips: what would only come straight back, and what the budget has room for.

A swapped layer's tensors stay on the device in a micro-batch whose own backward is the next
action (without a budget too: the backward's prefetch would bring them all back at once), and,
under a budget, in the micro-batches that the room left below it holds once the step's later
forwards are counted at their policies' footprint, last layers first, when their backward comes
before those forwards' backwards.
"""

from __future__ import annotations

import torch

from support.tensor_manager import assert_grads_equal, gpipe_step, make_manager, model_spec
from vpipe_lab.runtime.models import build_model

LAYERS = range(5)  # the test transformer: embedding, 3 blocks, head


def _d2h_per_step(steps: int, last_first: bool, **kwargs: object):
    """Per step, the bytes each layer copied to the host; the gradients; the manager."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, dict.fromkeys(LAYERS, "S"), **kwargs)
    torch.manual_seed(11)
    copied, grads = [], []
    for step in range(steps):
        before = {lid: layer.d2h_bytes for lid, layer in manager.stats().layers.items()}
        gpipe_step(model, spec, step, manager, last_first=last_first)
        copied.append({lid: layer.d2h_bytes - before.get(lid, 0)
                       for lid, layer in manager.stats().layers.items()})
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return copied, grads, manager


def _reference(steps: int, last_first: bool):
    return _reference_micro_batches(steps, 3, last_first)


def _reference_micro_batches(steps: int, micro_batches: int, last_first: bool):
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    torch.manual_seed(11)
    out = []
    for step in range(steps):
        gpipe_step(model, spec, step, None, micro_batches=micro_batches, last_first=last_first)
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return out


def test_the_micro_batch_whose_backward_comes_next_swaps_nothing_once_the_order_is_learned():
    copied, grads, manager = _d2h_per_step(3, last_first=True)
    # the first step learns the order; then the last of three micro-batches keeps: a third less per layer
    for lid in LAYERS[1:]:  # (the embedding saves the batch's input, one storage all micro-batches share)
        assert copied[1][lid] == copied[2][lid] == copied[0][lid] * 2 // 3, (lid, copied)
    assert copied[1][0] == copied[2][0] < copied[0][0]
    assert_grads_equal(grads, _reference(3, last_first=True))
    s = manager.stats()
    assert (
        s.sync_fallbacks == 0
        and s.h2d_bytes == s.d2h_bytes + s.refetched_bytes
        and s.live_saved_storages == 0
    )


def test_without_a_budget_micro_batches_waiting_for_others_backwards_still_swap_everything():
    copied, grads, _ = _d2h_per_step(3, last_first=False)
    assert copied[0] == copied[1] == copied[2] and all(copied[0][lid] > 0 for lid in LAYERS)
    assert_grads_equal(grads, _reference(3, last_first=False))


def test_under_a_budget_the_room_it_leaves_keeps_last_layers_first_and_is_never_passed():
    budget = 300_000  # every micro-batch swapped keeps ~45 KB; one kept whole ~275 KB
    copied, grads, manager = _d2h_per_step(3, last_first=False, budget_bytes=budget)
    assert copied[1] == copied[2]
    kept = [copied[0][lid] - copied[2][lid] for lid in LAYERS]  # what the micro-batches kept, per layer
    assert kept[-1] > 0 and sum(kept) < sum(copied[0].values())
    # each micro-batch keeps its last layers: a layer keeps in at least as many micro-batches as any before it
    shares = [k / copied[0][lid] for k, lid in zip(kept, LAYERS)]
    assert shares == sorted(shares), shares
    s = manager.stats()
    assert 0 < s.peak_resident_bytes <= budget and not s.escalations
    assert s.sync_fallbacks == 0 and s.h2d_bytes == s.d2h_bytes + s.refetched_bytes
    assert_grads_equal(grads, _reference(3, last_first=False))


def test_backwards_from_the_last_micro_batch_leave_the_room_to_it_not_to_the_first():
    budget = 400_000
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, dict.fromkeys(LAYERS, "S"), budget_bytes=budget)
    torch.manual_seed(11)
    on_host: list[dict[int, int]] = []
    grads = []
    for step in range(3):
        on_host.append({})
        gpipe_step(model, spec, step, manager, micro_batches=4, last_first=True,
                   before_backward=lambda mb: on_host[-1].setdefault(mb, manager._swap_in.host_bytes(mb)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    # the last micro-batch, whose backward comes first, keeps; the first one (backward last) does not take the
    # room first. While the kept micro-batch's backward frees its tensors, the next one's prefetch goes on (it
    # had stopped at the budget): both find nothing left on the host when they start.
    assert on_host[0][3] > 0 and on_host[2][3] == on_host[2][2] == 0, on_host
    s = manager.stats()
    assert 0 < s.peak_resident_bytes <= budget and not s.escalations and s.sync_fallbacks == 0
    assert_grads_equal(grads, _reference_micro_batches(3, micro_batches=4, last_first=True))
