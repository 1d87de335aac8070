"""The tensor manager facade: its arguments, its contexts, unmetered micro-batches that never ran their
backward, the learned step order driving prefetches, and what it says about itself.

(Gradients, byte counts, budgets, the pool and attaching to a stage have their own files.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from support.tensor_manager import gpipe_step, layers_of, make_manager, model_spec
from vpipe.tensor_manager import LayerBusyError, TensorManager
from vpipe_lab.runtime.models import build_model


@pytest.mark.parametrize("kwargs, message", [
    ({"budget_bytes": 0}, "budget_bytes must be a positive integer or None, got 0"),
    ({"budget_bytes": 1.5e9}, "budget_bytes must be a positive integer or None, got 1500000000.0"),
    ({"host_pool_bytes": -1}, "host_pool_bytes must be a positive integer or None, got -1"),
    ({"min_swap_bytes": -1}, "min_swap_bytes must be a non-negative integer, got -1"),
    ({"min_swap_bytes": "64K"}, "min_swap_bytes must be a non-negative integer, got '64K'"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError) as err:
        TensorManager({}, device="cpu", **kwargs)
    assert str(err.value) == message


def test_layers_must_be_modules_with_non_negative_integer_ids():
    manager = TensorManager({}, device="cpu")
    with pytest.raises(TypeError, match="^layer 3 must be an nn.Module, got int$"):
        manager.add_layer(3, 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^layer id must be a non-negative integer, got True$"):
        manager.add_layer(True, nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(KeyError,
                       match=r"layer 4 is not managed by this tensor manager \(it manages layers \[\]\)"):
        manager.remove_layer(4)
    assert manager.layer_ids == []


def test_a_forward_that_starts_inside_another_is_refused_and_the_outer_one_goes_on():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model)
    x, _ = spec.batch(0, 2, 0)
    with manager.micro_batch(0):
        with pytest.raises(RuntimeError,
                           match="^micro-batch 1's forward started inside micro-batch 0's forward$"):
            with manager.micro_batch(1):
                pass
        model(x)
    assert all(set(s.activation_bytes) == {0} for s in manager.stats().layers.values())


def test_an_evaluation_forward_in_a_micro_batch_saves_and_counts_nothing():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, {1: "S", 2: "R"})
    x, _ = spec.batch(0, 2, 0)
    with torch.no_grad(), manager.micro_batch(0):
        model(x)
    s = manager.stats()
    assert s.resident_bytes == s.peak_resident_bytes == 0 and s.live_saved_storages == 0 and s.d2h_bytes == 0
    assert all(not layer.activation_bytes and layer.recomputes == 0 for layer in s.layers.values())


def test_swapping_pins_the_first_host_chunk_when_the_policy_is_set():
    model = build_model(model_spec("cnn"), seed=0)
    manager = make_manager(model)  # chunks of 1 MiB
    assert manager.stats().host_pool_capacity_bytes == 0  # a stage that only keeps pins nothing
    manager.set_policy(1, "S")
    assert manager.stats().host_pool_capacity_bytes == 1 << 20


def _unmetered_forwards(micro_batches: list[int]):
    """One metered GPipe step (the kept layers' bytes are learned), then forwards with metering off, no
    backward; returns the resident bytes after each of those forwards."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model)
    torch.manual_seed(0)
    gpipe_step(model, spec, 0, manager)
    manager.metering = False
    x, y = spec.batch(1, 2, 0)
    losses, resident = [], []
    for mb in micro_batches:
        with manager.micro_batch(mb):
            losses.append(spec.loss_fn()(model(x), y))
        resident.append(manager.ledger.resident)
    return model, manager, resident, losses


def test_micro_batches_whose_backward_never_ran_are_not_counted_forever():
    """A step that failed between forwards and backwards: the next
    step's forwards, or end_of_step(), uncount them."""
    model, manager, resident, _ = _unmetered_forwards([0, 1])
    per_mb = resident[0]
    assert per_mb > 0 and resident[1] == 2 * per_mb  # counted with the metered call's bytes
    x, y = model_spec("transformer").batch(1, 2, 0)
    with manager.micro_batch(0):  # micro-batch 0 again: the earlier one is gone, this one counts
        model(x)
    assert manager.ledger.resident == 2 * per_mb
    manager.end_of_step()
    assert manager.ledger.resident == 0


def test_a_layer_with_unmetered_calls_waiting_for_their_backward_cannot_leave():
    model, manager, _, losses = _unmetered_forwards([0])
    with pytest.raises(LayerBusyError, match=r"^layer 2 still has saved activations of micro-batches \[0\]"):
        manager.remove_layer(2)
    with manager.backward(0):
        losses[0].backward()
    assert manager.ledger.resident == 0
    assert manager.remove_layer(2) is model[2] and manager.layer_ids == [0, 1, 3, 4]
    assert 2 not in manager.stats().layers and 2 not in manager.layer_saved_bytes()
    manager.add_layer(2, model[2])  # back again: measured afresh
    assert manager.stats().layers[2].activation_bytes == {}


def test_a_learned_step_order_prefetches_each_backward_before_it_starts():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, dict.fromkeys(range(5), "S"))
    on_host: list[list[int]] = []
    torch.manual_seed(0)
    for step in range(2):  # GPipe order; every micro-batch its own input storage (views would share one)
        x, y = spec.batch(step, 6, 0)
        losses = []
        for mb, (xm, ym) in enumerate(zip(x.tensor_split(3), y.tensor_split(3))):
            with manager.micro_batch(mb):
                losses.append(spec.loss_fn()(model(xm.clone()), ym))
        on_host.append([])
        for mb, loss in enumerate(losses):
            on_host[-1].append(manager._swap_in.host_bytes(mb))
            with manager.backward(mb):
                loss.backward()
    # the first step: each backward fetched its own micro-batch when it
    # started; the second: the action before did
    assert all(n > 0 for n in on_host[0]) and on_host[1] == [0, 0, 0]
    s = manager.stats()
    assert s.sync_fallbacks == 0 and s.h2d_bytes == s.d2h_bytes and s.live_saved_storages == 0


def test_what_it_says_about_itself_and_that_it_stays_closed():
    model = build_model(model_spec("transformer"), seed=0)
    manager = TensorManager(layers_of(model), device="cpu", policies={1: "S", 2: "R"}, budget_bytes=3 << 20)
    assert (
        repr(manager) == "TensorManager(device=cpu, layers=[0, 1, 2, 3, 4], policies=DSRDD, budget=3.0 MiB)"
    )
    assert manager.layer_saved_bytes() == dict.fromkeys(range(5), 0)  # nothing ran yet
    manager.close()
    for call in (lambda: manager.add_layer(9, nn.Linear(2, 2)), lambda: manager.set_policy(0, "S"),
                 lambda: manager.micro_batch(0).__enter__()):
        with pytest.raises(RuntimeError, match="^this tensor manager is closed$"):
            call()
    assert manager.stats().layers.keys() == {0, 1, 2, 3, 4}  # still readable
