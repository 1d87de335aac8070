"""Kept layers run without saved-tensor hooks when nothing needs them, and are still counted."""

from __future__ import annotations

import pytest
import torch

from support.tensor_manager import gpipe_step, make_manager, model_spec
from vpipe.tensor_manager import LayerBusyError
from vpipe_lab.runtime.models import build_model


class _PackCounter:
    """Counts the calls of the manager's pack hook (the per-tensor work the fast path avoids)."""

    def __init__(self, manager) -> None:
        self.calls = 0
        hooks = manager._interceptor
        inner = hooks.pack

        def pack(t):
            self.calls += 1
            return inner(t)

        hooks.hooks = torch.autograd.graph.saved_tensors_hooks(pack, hooks.unpack)


def _run(steps: int, metering_from: int, policies=None, budget: int | None = None, batch_at=None):
    """``steps`` GPipe steps of the transformer; metering on for steps before ``metering_from``."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, policies, budget_bytes=budget)
    counter = _PackCounter(manager)
    packs, resident_mid = [], []
    torch.manual_seed(0)  # the same dropout masks in every run
    for step in range(steps):
        manager.metering = step < metering_from
        before = counter.calls
        gpipe_step(model, spec, step, manager,
                   before_backward=lambda mb: resident_mid.append(manager.ledger.resident) if mb == 0
                   else None)
        packs.append(counter.calls - before)
    return model, manager, packs, resident_mid


def test_kept_layers_skip_the_hooks_once_measured_and_train_bitwise_like_metered_ones():
    metered, _, metered_packs, metered_resident = _run(3, metering_from=3)
    fast, manager, packs, resident = _run(3, metering_from=1)
    assert metered_packs[1] > 0 and packs[0] == metered_packs[0]
    assert packs[1:] == [0, 0]  # no pack hook at all once every layer's bytes are known
    # gradients accumulated over the three steps (dropout included), bit for bit
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(fast.parameters(), metered.parameters()))
    # the ledger counts the measured bytes while the micro-batches wait for their backward, and none after
    per_mb = sum(layer.kept_bytes for layer in manager._layers.values())
    assert resident[1] == resident[2] == 3 * per_mb  # three micro-batches wait for their backward
    # never less than the exact count: a storage the micro-batches share (a constant) counts with each
    assert resident[1] >= metered_resident[1] > 0
    assert manager.ledger.resident == 0


def test_without_a_budget_the_kept_layers_carry_no_hooks_between_metered_steps():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model)
    hooked = lambda: [bool(layer._forward_pre_hooks) for layer in model]  # noqa: E731
    assert all(hooked())  # nothing measured yet
    gpipe_step(model, spec, 0, manager)
    manager.metering = False
    assert not any(hooked())  # measured, kept, no budget, not metering: nothing to do per call
    manager.metering = True
    assert all(hooked())
    manager.metering = False
    manager.set_policy(2, "S")
    assert all(hooked())  # a swapped layer: every call is seen again
    manager.set_policy(2, "D")
    manager.budget_bytes = 1 << 30
    assert all(hooked())  # a budget: each call is checked against it


def test_a_retired_layer_is_not_counted_for_later_micro_batches_and_leaves_after_its_backwards():
    """A streamed move switches a layer out of the forward path while earlier micro-batches still need it."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model)
    gpipe_step(model, spec, 0, manager)
    manager.metering = False  # no hooks: a micro-batch is counted with its layers when its forward ends
    x, y = spec.batch(1, 4, 0)
    with manager.micro_batch(0):
        first = model(x[:2])
    manager.retire_layer(2)
    without_2 = torch.nn.Sequential(*(layer for i, layer in enumerate(model) if i != 2))
    with manager.micro_batch(1):
        second = without_2(x[2:])
    with pytest.raises(LayerBusyError, match=r"layer 2 still has saved activations of micro-batches \[0\]"):
        manager.remove_layer(2)
    with manager.backward(0):
        spec.loss_fn()(first, y[:2]).backward()
    manager.remove_layer(2)  # micro-batch 1 never ran it
    with manager.backward(1):
        spec.loss_fn()(second, y[2:]).backward()
    assert manager.ledger.resident == 0


def test_under_a_budget_a_call_with_new_input_shapes_is_measured_again():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, budget_bytes=1 << 30)  # roomy: the kept calls skip the saved-tensor hooks
    counter = _PackCounter(manager)
    gpipe_step(model, spec, 0, manager)
    small = {lid: layer.kept_bytes for lid, layer in manager._layers.items()}
    manager.metering = False
    before = counter.calls
    x, y = spec.batch(1, 8, 0)  # micro-batches of 4 samples instead of 2
    with manager.micro_batch(0):
        out = model(x[:4])
    assert counter.calls > before
    with manager.backward(0):
        spec.loss_fn()(out, y[:4]).backward()
    for lid, layer in manager._layers.items():  # what later unmetered calls are counted with is the new size
        assert layer.kept_bytes == manager.ledger.activation[lid][0] > small[lid]
    assert manager.ledger.resident == 0


def test_under_a_roomy_budget_kept_layers_run_without_hooks_until_the_inputs_change():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, budget_bytes=1 << 30)  # a step's micro-batches fit many times over
    counter = _PackCounter(manager)
    hooked = lambda: [bool(layer._forward_pre_hooks) for layer in model]  # noqa: E731
    gpipe_step(model, spec, 0, manager, pass_inputs=True)  # measured
    manager.metering = False
    assert not any(hooked())  # measured, kept, the budget holds the step: nothing to check per call
    before = counter.calls
    gpipe_step(model, spec, 1, manager, pass_inputs=True)
    assert counter.calls == before and not any(hooked()) and manager.ledger.resident == 0
    per_mb = sum(layer.kept_bytes for layer in manager._layers.values())
    # inputs of another shape: the hooks come back before that micro-batch's forward, which is measured
    x, y = spec.batch(2, 8, 0)
    with manager.micro_batch(0, (x[:4],)):
        assert all(hooked())
        out = model(x[:4])
    assert counter.calls > before
    with manager.backward(0):
        spec.loss_fn()(out, y[:4]).backward()
    assert sum(layer.kept_bytes for layer in manager._layers.values()) > per_mb
    # a caller that does not say what the inputs are is watched, as is a budget the step does not fit
    manager.metering = True
    manager.metering = False
    assert not any(hooked())
    with manager.micro_batch(0):
        assert all(hooked())
    manager.end_of_step()
    manager.metering = True
    gpipe_step(model, spec, 3, manager, pass_inputs=True)
    manager.budget_bytes = 3 * sum(layer.kept_bytes for layer in manager._layers.values()) - 1  # a byte short
    manager.metering = False
    assert all(hooked())


def test_swapped_layers_and_a_tight_budget_keep_every_call_metered():
    _, _, swap_packs, _ = _run(2, metering_from=0, policies={1: "S"})
    assert swap_packs[1] > 0  # one layer swaps: the whole stage is metered (shared storages stay exact)
    _, probe, _, _ = _run(1, metering_from=1)
    per_mb = sum(layer.kept_bytes for layer in probe._layers.values())
    _, _, exact, _ = _run(2, metering_from=1, budget=3 * per_mb)
    # three micro-batches in flight fit to the byte: no margin (the plain schedule has none)
    assert exact[1] == 0
    _, _, short, _ = _run(2, metering_from=1, budget=3 * per_mb - 1)
    assert short[1] > 0  # a byte short: every byte is counted exactly


def test_a_storage_two_layers_save_is_counted_once_by_unmetered_calls_as_by_metered_ones():
    # each Tanh saves its output, which the next Linear saves as its input: one storage, two layers
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(),
                                torch.nn.Linear(64, 8))
    manager = make_manager(model, budget_bytes=1 << 30)  # a budget far away: kept layers may run unmetered
    x = torch.randn(4, 16)

    def forward_resident(mb: int) -> int:
        with manager.micro_batch(mb):
            out = model(x)
        resident = manager.ledger.resident
        with manager.backward(mb):
            out.sum().backward()
        return resident

    manager.metering = True
    metered = forward_resident(0)
    manager.metering = False
    unmetered = forward_resident(1)
    assert not manager._interceptor.counted  # counted while it waited for its backward, and no longer
    # the Linears' inputs after the first are the Tanhs' outputs: counted once, as the metered call did
    assert unmetered == metered == sum(layer.kept_bytes for layer in manager._layers.values())
    floats = 4  # bytes
    assert {lid: layer.kept_bytes for lid, layer in manager._layers.items()} == {
        0: 4 * 16 * floats, 1: 4 * 64 * floats, 2: 0, 3: 4 * 64 * floats, 4: 0}


def test_with_no_hooks_and_nothing_saved_through_them_a_micro_batch_only_keeps_its_count():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model)
    engine = manager._engine
    drains = []
    inner_drain = engine.drain
    engine.drain = lambda: drains.append(1) or inner_drain()  # the per-micro-batch release work
    x, y = spec.batch(0, 4, 0)
    with manager.micro_batch(0):  # metered: its saved tensors go through the hooks
        metered = model(x[:2])
    manager.metering = False
    with manager.micro_batch(1):  # hooks off, but micro-batch 0's tensors are alive: the full path
        unmetered = model(x[2:])
    assert drains and manager.ledger.resident_of(0).keys() == {0, 1}
    with manager.backward(0):
        spec.loss_fn()(metered, y[:2]).backward()
    with manager.backward(1):
        spec.loss_fn()(unmetered, y[2:]).backward()
    assert engine.idle and manager.ledger.resident == 0
    drains.clear()
    resident = []
    gpipe_step(model, spec, 1, manager, before_backward=lambda mb: resident.append(manager.ledger.resident))
    assert not drains  # nothing to release, copy, fetch or decide
    per_mb = sum(layer.kept_bytes for layer in manager._layers.values())
    assert resident == [3 * per_mb, 2 * per_mb, per_mb]  # counted until each backward ends
    assert manager.ledger.resident == 0 and not manager._interceptor.counted


def test_the_pipelining_wrapper_hands_the_manager_a_chunks_inputs_flat():
    from vpipe.tensor_manager.pipelining import _stage_inputs

    x, mask = torch.zeros(2, 3), torch.ones(2)
    assert _stage_inputs(((x,), {"mask": mask}), {}) == (x, mask)  # forward_one_chunk(id, args, kwargs)
    assert _stage_inputs(((x,),), {"kwargs": None}) == (x,)
    assert _stage_inputs((), {"args": (x,), "kwargs": {"mask": mask}}) == (x, mask)
    assert _stage_inputs(((),), {}) == ()  # a later stage: torch passes no args, it receives into buffers
