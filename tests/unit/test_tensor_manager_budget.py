"""The device budget: extra swaps/recomputes when it would be exceeded, clear errors when it cannot be met."""

from __future__ import annotations

import logging

import pytest
import torch

from support.tensor_manager import (
    LateCopies,
    assert_grads_equal,
    gpipe_step,
    make_manager,
    model_spec,
    train_grads,
)
from vpipe.plan import Policy
from vpipe.tensor_manager import MemoryBudgetError
from vpipe.tensor_manager.accounting import Ledger
from vpipe.tensor_manager.budget import LayerEstimate, cheapest_escalations, exposed_copy_s
from vpipe.tensor_manager.copy_engine import CpuCopyEngine
from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.layers import ManagedLayer
from vpipe.tensor_manager.pool import HostPool
from vpipe.tensor_manager.swap import SwapEngine
from vpipe_lab.runtime.models import build_model


def _peak_all_kept(kind: str, micro_batches: int) -> int:
    _, manager = train_grads(kind, {}, steps=1, micro_batches=micro_batches)
    return manager.stats().peak_resident_bytes


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_budget_of_40_percent_holds_and_gradients_stay_exact(kind, caplog):
    peak = _peak_all_kept(kind, micro_batches=4)
    budget = int(0.4 * peak)
    want, _ = train_grads(kind, None, steps=3, micro_batches=4)
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    manager = make_manager(model, budget_bytes=budget)
    torch.manual_seed(11)
    got = []
    with caplog.at_level(logging.INFO, logger="vpipe.decisions"):
        for step in range(3):
            gpipe_step(model, spec, step, manager, micro_batches=4)
            got.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
    assert_grads_equal(got, want)
    s = manager.stats()
    assert 0 < s.peak_resident_bytes <= budget
    assert s.escalations, "a 40% budget must make the manager swap or recompute something"
    assert all(old is Policy.KEEP for _, old, _ in s.escalations)
    logged = [r for r in caplog.records if getattr(r, "vpipe_fields", {}).get("event") == "policy"]
    assert len(logged) == len(s.escalations)
    assert logged[0].vpipe_fields["budget_bytes"] == budget


def test_budget_recomputes_when_the_host_pool_cannot_take_swaps():
    peak = _peak_all_kept("transformer", micro_batches=4)
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, budget_bytes=int(0.5 * peak), host_pool_bytes=4096,
                           host_pool_chunk_bytes=4096)
    for step in range(2):
        gpipe_step(model, spec, step, manager, micro_batches=4)
    s = manager.stats()
    assert s.peak_resident_bytes <= int(0.5 * peak)
    assert any(new is Policy.RECOMPUTE for _, _, new in s.escalations)
    assert s.host_pool_used_bytes == 0


def test_a_layer_larger_than_the_budget_is_named():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, budget_bytes=16 * 1024)
    x, _ = spec.batch(0, 2, 0)
    with pytest.raises(MemoryBudgetError, match=r"layer 1 needs 85\.5 KiB of saved activations even fully "
                                                r"recomputed > budget 16\.0 KiB"):
        with manager.micro_batch(0):
            model(x)
    assert isinstance(MemoryBudgetError("x"), ValueError)


def test_too_many_micro_batches_in_flight_for_the_budget_is_an_error():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    # room for the largest layer's backward, but not for 4 micro-batches of recomputed inputs besides
    manager = make_manager(model, budget_bytes=90 * 1024, host_pool_bytes=4096, host_pool_chunk_bytes=4096)
    with pytest.raises(MemoryBudgetError,
                       match=r"stage budget 90\.0 KiB cannot hold 2 micro-batches in flight: "
                                                r"even with every layer swapped or recomputed each keeps"):
        gpipe_step(model, spec, 0, manager, micro_batches=4)


def test_escalations_go_from_recompute_to_swap_when_recompute_was_not_lean_enough():
    """A recompute is cheapest per byte but keeps the inputs; only a swap (which keeps nothing) gets there."""
    estimates = [LayerEstimate(0, Policy.KEEP, activation_bytes=1000, swappable_bytes=1000, input_bytes=400,
                               forward_s=0.001)]
    changes = cheapest_escalations(estimates, 1000, swap_s_per_byte=1e-3, overlap=0.0, pool_free_bytes=10**9,
                                   budget_bytes=4000, context="test")
    assert [(c.layer_id, c.old, c.new, c.saved_bytes) for c in changes] == [
        (0, Policy.KEEP, Policy.RECOMPUTE, 600), (0, Policy.RECOMPUTE, Policy.SWAP, 400)]


def test_escalations_pick_the_cheapest_seconds_per_byte():
    estimates = [
        LayerEstimate(0, Policy.KEEP, activation_bytes=1000, swappable_bytes=1000, input_bytes=100,
                      forward_s=1.0),
        LayerEstimate(1, Policy.KEEP, activation_bytes=1000, swappable_bytes=1000, input_bytes=100,
                      forward_s=0.01),
        LayerEstimate(2, Policy.SWAP, activation_bytes=800, swappable_bytes=800, input_bytes=100,
                      forward_s=0.01),
    ]
    # copies cost 1 ms per byte: recomputing layer 1 (10 ms) beats swapping anything (2 s per 1000 bytes)
    changes = cheapest_escalations(estimates, 500, swap_s_per_byte=1e-3, overlap=0.0, pool_free_bytes=10**9,
                                   budget_bytes=4000, context="test")
    assert [(c.layer_id, c.new) for c in changes] == [(1, Policy.RECOMPUTE)]
    # free copies (fully overlapped): swap first, the bigger saving among equals
    changes = cheapest_escalations(estimates, 1500, swap_s_per_byte=1e-9, overlap=3.0, pool_free_bytes=10**9,
                                   budget_bytes=4000, context="test")
    assert [(c.layer_id, c.new) for c in changes] == [(0, Policy.SWAP), (1, Policy.SWAP)]
    # no pool: only recompute is possible (saving 1800 bytes); the error names the 2200 still missing
    with pytest.raises(MemoryBudgetError, match=r"test: 2\.1 KiB more than the budget 3\.9 KiB even with"):
        cheapest_escalations(estimates, 4000, swap_s_per_byte=1e-9, overlap=3.0, pool_free_bytes=0,
                             budget_bytes=4000, context="test")
    # best effort (the projection before a micro-batch): what helps, without the error
    changes = cheapest_escalations(estimates, 4000, swap_s_per_byte=1e-9, overlap=3.0, pool_free_bytes=0,
                                   budget_bytes=4000, context="test", best_effort=True)
    assert sorted((c.layer_id, c.new) for c in changes) == [(0, Policy.RECOMPUTE), (1, Policy.RECOMPUTE)]


def test_swaps_fill_the_copy_engine_behind_the_forward_and_recomputes_take_the_rest():
    """Three layers of 1 s forward each: the swap-outs of a micro-batch hide behind its 3 s of forward."""
    estimates = [LayerEstimate(lid, Policy.KEEP, activation_bytes=1000, swappable_bytes=1000, input_bytes=100,
                               forward_s=1.0) for lid in range(3)]

    def chosen(swap_s_per_byte: float) -> list[tuple[int, Policy]]:
        changes = cheapest_escalations(estimates, 2700, swap_s_per_byte=swap_s_per_byte, overlap=1.0,
                                       pool_free_bytes=10**9, budget_bytes=4000, context="test")
        return [(c.layer_id, c.new) for c in changes]

    # 0.5 s of copy per layer: all three swaps fit in the 3 s window, free
    assert chosen(0.5e-3) == [(0, Policy.SWAP), (1, Policy.SWAP), (2, Policy.SWAP)]
    # 1.5 s per layer: two swaps fill the window; a third would expose
    # 1.5 s, more per byte than its 1 s recompute
    assert chosen(1.5e-3) == [(0, Policy.SWAP), (1, Policy.SWAP), (2, Policy.RECOMPUTE)]
    # (a swap-in has the backward, twice the forward: only the swap-outs' window counted above)
    assert exposed_copy_s(4.5, 3.0, 1.0) == 1.5 and exposed_copy_s(7.0, 3.0, 1.0) == 4.0 + 1.0
    assert exposed_copy_s(1.0, 3.0, 0.0) == 2.0  # synchronous copies: out and back, both paid


@pytest.mark.parametrize("copies_late", [True, False])
def test_swap_outs_still_copying_count_as_gone_when_the_budget_projects(copies_late):
    """Three micro-batches of a swapped and a kept layer, 4 KiB each, under a budget for four in flight.

    With the copies still running (a GPU's copy stream behind), the swapped bytes are still on the
    device but on their way out: no escalation, and a pack that needs their room waits for them.
    Had they stayed, the same projection escalates."""
    kib = 1024
    ledger = Ledger()
    engine = SwapEngine(torch.device("cpu"), ledger, LateCopies(),
                        lambda: HostPool(64 * kib, pinned=False, chunk_bytes=16 * kib))
    layers = {0: ManagedLayer(0, torch.nn.Identity(), Policy.SWAP, forward_s=1e-3),
              1: ManagedLayer(1, torch.nn.Identity(), Policy.KEEP, forward_s=1e-3)}
    governor = BudgetGovernor(4 * kib + 4 * 4 * kib, 64 * kib, ledger=ledger, engine=engine, layers=layers)
    governor.reserve = 4 * kib
    held = []
    for mb in range(3):
        for lid in (0, 1):
            ledger.record_activation(lid, mb, 4 * kib, swappable=4 * kib)
            t = torch.ones(kib)
            storage = t.untyped_storage()
            args = (t, lid, mb, storage.data_ptr(), storage.nbytes())
            held.append(engine.swap_out(t, storage, *args[1:]) if lid == 0 and copies_late
                        else engine.keep(*args))
        engine.flush_swap_outs()
    assert ledger.resident == 24 * kib and engine.outgoing_bytes() == (12 * kib if copies_late else 0)
    governor.fit(3, in_flight=4, lag_share=0.0, all_keep=False, set_policy=lambda *_: None)
    assert governor.escalations == ([] if copies_late else [(1, Policy.KEEP, Policy.SWAP)])
    # a pack that needs room waits for the late copies (a wait counted); kept bytes force it to swap instead
    assert governor.forces_swap(key=1, nbytes=4 * kib) is (not copies_late)
    assert (governor.waits, ledger.resident) == ((1, 12 * kib) if copies_late else (0, 24 * kib))


def test_a_pack_over_the_budget_first_issues_the_swap_outs_its_layer_has_packed():
    """A layer's swap-outs go as one batch after its forward; a tensor that would pass the budget before then
    issues them (synchronous on CPU: their device bytes go at once) rather than being swapped itself."""
    kib = 1024
    ledger = Ledger()
    engine = SwapEngine(torch.device("cpu"), ledger, CpuCopyEngine(torch.device("cpu")),
                        lambda: HostPool(64 * kib, pinned=False, chunk_bytes=16 * kib))
    governor = BudgetGovernor(8 * kib, 64 * kib, ledger=ledger, engine=engine, layers={})
    held = []
    for t, out in ((torch.ones(kib), True), (torch.ones(kib), False)):
        storage = t.untyped_storage()
        args = (t, storage, 0, 0, storage.data_ptr(), storage.nbytes())
        held.append(engine.swap_out(*args) if out else engine.keep(t, *args[2:]))
    assert ledger.resident == 8 * kib and engine.swap_outs_in_flight  # the swap-out is packed, not issued
    assert governor.forces_swap(key=1, nbytes=4 * kib) is False
    assert (ledger.resident, governor.waits) == (4 * kib, 1)


def test_a_recomputed_layer_whose_input_is_big_goes_to_swap():
    # recompute keeps the 900-byte input, a swap keeps only the 100 unswappable bytes
    estimates = [LayerEstimate(0, Policy.RECOMPUTE, activation_bytes=1000, swappable_bytes=900,
                               input_bytes=900,
                               forward_s=0.01)]
    changes = cheapest_escalations(estimates, 800, swap_s_per_byte=1e-9, overlap=0.0, pool_free_bytes=10**9,
                                   budget_bytes=4000, context="test")
    assert [(c.layer_id, c.old, c.new, c.saved_bytes) for c in changes] == [(0, Policy.RECOMPUTE, Policy.SWAP,
                                                                             800)]
    assert changes[0].cost_s == 0.0  # the copies are cheaper than the forward it no longer repeats


def test_escalations_are_undone_once_the_budget_holds_every_layer_kept_but_a_plans_policies_stay():
    kind = "transformer"
    peak = _peak_all_kept(kind, micro_batches=4)
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    # a share of a rank's budget before needs are known
    manager = make_manager(model, budget_bytes=int(0.4 * peak))
    gpipe_step(model, spec, 0, manager, micro_batches=4)
    escalated = {lid for lid, _, _ in manager.stats().escalations}
    assert escalated and manager.keep_all_bytes() > 0
    manager.relax()  # the budget still cannot hold everything: nothing changes
    assert {lid for lid, pol in manager.policies().items() if pol is not Policy.KEEP} == escalated
    manager.budget_bytes = manager.keep_all_bytes()  # the share grew to what keeping everything takes
    manager.relax()
    assert set(manager.policies().values()) == {Policy.KEEP}
    gpipe_step(model, spec, 1, manager, micro_batches=4)
    assert {lid for lid, _, _ in manager.stats().escalations} == escalated  # none made again
    assert manager.stats().peak_resident_bytes <= manager.budget_bytes
    # a plan's swap is the plan's: relaxing leaves it
    manager.budget_bytes = int(0.4 * peak)
    gpipe_step(model, spec, 2, manager, micro_batches=4)
    # (which layers the budget picks depends on measured times: under load it may pick others than at step 0)
    escalated = {lid for lid, pol in manager.policies().items() if pol is not Policy.KEEP}
    manager.set_policies({lid: Policy.SWAP for lid in escalated})
    manager.budget_bytes = manager.keep_all_bytes()
    manager.relax()
    assert escalated and {lid for lid, pol in manager.policies().items() if pol is Policy.SWAP} == escalated


def test_a_stage_that_never_kept_every_layer_counts_its_layers_activations_summed_as_its_need():
    kind = "transformer"
    peak = _peak_all_kept(kind, micro_batches=4)
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    manager = make_manager(model, budget_bytes=int(0.2 * peak))  # escalates from its first micro-batch on
    gpipe_step(model, spec, 0, manager, micro_batches=4)
    # no micro-batch kept everything
    assert manager.stats().escalations and manager._budget.kept_per_mb is None
    summed = sum(manager.ledger.activation_bytes(lid) for lid in manager.policies())
    kept, in_flight = manager.keep_all_need()
    assert (kept, in_flight) == (summed, 4)
    assert summed >= peak // 4  # never less than what a micro-batch keeps with every layer kept
    manager.budget_bytes = kept * in_flight  # a share that holds it: the stage keeps every layer again
    manager.relax()
    assert set(manager.policies().values()) == {Policy.KEEP}
    before = len(manager.stats().escalations)
    gpipe_step(model, spec, 1, manager, micro_batches=4)
    # the micro-batches agree with relax(): they keep every layer (no escalating again, step after step) and
    # measure what that keeps
    assert len(manager.stats().escalations) == before and set(manager.policies().values()) == {Policy.KEEP}
    assert 0 < manager.keep_all_need()[0] <= summed


def test_escalations_stay_while_a_plans_swap_keeps_the_stage_from_keeping_every_layer():
    """Undoing them would not make the stage keep everything (the plan's swap stays): its micro-batches would
    project with a backward reserve and escalate again, at every step."""
    kind = "transformer"
    peak = _peak_all_kept(kind, micro_batches=4)
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    manager = make_manager(model, {0: "S"}, budget_bytes=int(0.3 * peak))  # layer 0 swapped by a plan
    gpipe_step(model, spec, 0, manager, micro_batches=4)
    policies = manager.policies()
    assert {lid for lid, _, _ in manager.stats().escalations} - {0}
    manager.budget_bytes = manager.keep_all_bytes()  # keeping every layer would fit
    manager.relax()
    assert manager.policies() == policies
