"""Attaching, migrating layers, closing: the modules and stages come back exactly as they were."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from support.tensor_manager import make_manager, model_spec
from vpipe.plan import PlanError, Policy
from vpipe.tensor_manager import LayerBusyError, install_on_stage
from vpipe.tensor_manager.prefetch import BACKWARD, FORWARD, ArrivalPredictor
from vpipe_lab.runtime.launch import free_port
from vpipe_lab.runtime.models import build_model


def _snapshot(module: nn.Module) -> dict:
    return {name: (dict(m.__dict__), dict(m._forward_hooks), dict(m._forward_pre_hooks))
            for name, m in module.named_modules()}


def test_close_restores_every_module_exactly():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    custom = lambda x: x  # noqa: E731 - a forward someone set on the instance before vpipe
    model[4].forward = custom
    before = _snapshot(model)
    manager = make_manager(model, {0: "R", 1: "S", 2: "R", 4: "R"})
    assert "forward" in model[0].__dict__ and model[4].forward is not custom
    assert model[1]._forward_hooks and model[1]._forward_pre_hooks
    manager.set_policy(2, "D")  # leaving R removes the attribute at once
    assert "forward" not in model[2].__dict__
    manager.close()
    manager.close()  # idempotent
    assert _snapshot(model) == before
    assert model[4].forward is custom
    with pytest.raises(RuntimeError, match="closed"):
        manager.set_policy(0, "S")


@pytest.mark.parametrize("fault", ["policy", "layer", "shared"])
def test_a_manager_that_fails_half_way_leaves_every_module_as_it_was(fault):
    """Layers 0-2 taken (0 under R: a forward attribute), then a bad policy, a non-module or a module already
    taken: the error is the caller's, and no hook, forward attribute or claim stays on any module."""
    from vpipe.tensor_manager import TensorManager

    model = build_model(model_spec("transformer"), seed=0)
    before = _snapshot(model)
    layers: dict[int, object] = {i: model[i] for i in range(4)}
    policies: dict[int, str] = {0: "R", 1: "S"}
    expected: tuple[type[Exception], str] = (PlanError, "unknown policy 'X'; expected one of D, S, R")
    if fault == "policy":
        policies[3] = "X"
    elif fault == "layer":
        layers[3], expected = "not a module", (TypeError, "layer 3 must be an nn.Module")
    else:
        layers[3], expected = model[1], (ValueError, "already managed by this tensor manager")
    with pytest.raises(expected[0], match=expected[1]):
        TensorManager(layers, device="cpu", policies=policies, host_pool_bytes=32 << 20,
                      # type: ignore[arg-type]
                      host_pool_chunk_bytes=1 << 20)
    assert _snapshot(model) == before
    make_manager(model, {0: "R"}).close()  # nothing claimed any more: a new manager takes them all
    assert _snapshot(model) == before


def test_saved_tensors_stay_usable_after_close():
    spec = model_spec("cnn")
    model = build_model(spec, seed=0)
    x, y = spec.batch(0, 2, 0)
    manager = make_manager(model, {0: "S", 1: "R", 2: "S"})
    with manager.micro_batch(0):
        loss = spec.loss_fn()(model(x), y)
    manager.close()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert manager.stats().live_saved_storages == 0


def test_layers_migrate_between_managers():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    a = make_manager(nn.Sequential())  # an empty stage; layers arrive below
    for lid in range(3):
        a.add_layer(lid, model[lid], policy="S" if lid == 2 else "D")
    b = make_manager(nn.Sequential())
    b.add_layer(3, model[3])
    b.add_layer(4, model[4])
    x, y = spec.batch(0, 2, 0)
    with a.micro_batch(0), b.micro_batch(0):
        loss = spec.loss_fn()(model(x), y)
    with pytest.raises(LayerBusyError, match=r"layer 2 still has saved activations of micro-batches \[0\]"):
        a.remove_layer(2)
    with pytest.raises(ValueError, match="already managed by another tensor manager"):
        b.add_layer(2, model[2])
    with pytest.raises(ValueError, match="layer 3 is already managed by this"):
        b.add_layer(3, model[3])
    with pytest.raises(ValueError, match="non-negative integer"):
        b.add_layer(-1, nn.Linear(2, 2))
    with a.backward(0), b.backward(0):
        loss.backward()
    moved = a.remove_layer(2)  # its saved tensors are gone: it may migrate to b
    assert moved is model[2] and not moved._forward_hooks and a.layer_ids == [0, 1]
    b.add_layer(2, moved, policy=Policy.RECOMPUTE)
    assert b.layer_ids == [2, 3, 4] and b.policy(2) is Policy.RECOMPUTE
    with a.micro_batch(1), b.micro_batch(1):
        model(x)
    assert b.stats().layers[2].activation_bytes == {1: a.stats().layers[1].activation_bytes[1]}


def test_predictor_learns_the_step_order():
    clock = iter(range(1000))
    predictor = ArrivalPredictor(clock=lambda: float(next(clock)))
    gpipe = [(FORWARD, 0), (FORWARD, 1), (FORWARD, 2), (BACKWARD, 0), (BACKWARD, 1), (BACKWARD, 2)]
    for kind, mb in gpipe:
        assert predictor.observe(kind, mb) is False
        assert predictor.upcoming(lambda mb: 0.0) == []  # nothing learned during the first step
    answers = []
    for kind, mb in gpipe:
        predictor.observe(kind, mb)
        answers.append(predictor.upcoming(lambda mb: 0.0))
    # the next action's backward, and only that one while copies are instant
    assert answers == [[], [], [0], [1], [2], []]
    predictor.observe(FORWARD, 0)
    assert predictor.upcoming(lambda mb: 100.0) == [0, 1, 2]  # slow copies: all must start now
    predictor.observe(FORWARD, 2)  # the order changed: no prediction until it is learned again
    assert predictor.upcoming(lambda mb: 100.0) == []


def test_predictor_walks_a_micro_batch_for_its_copy_time_only_where_the_bound_reaches():
    clock = iter(range(1000))
    predictor = ArrivalPredictor(safety=1.0, clock=lambda: float(next(clock)))
    gpipe = [(FORWARD, 0), (FORWARD, 1), (FORWARD, 2), (BACKWARD, 2), (BACKWARD, 1), (BACKWARD, 0)]
    for _ in range(2):
        for kind, mb in gpipe[:3]:
            predictor.observe(kind, mb)
        for kind, mb in gpipe[3:]:
            predictor.observe(kind, mb)
    predictor.observe(FORWARD, 0)
    for kind, mb in gpipe[1:3]:
        predictor.observe(kind, mb)
    # backward 2 is next (always in); backward 1 starts 2 s later, backward 0 3 s later
    asked: list[int] = []

    def exact(mb: int) -> float:
        asked.append(mb)
        return 2.5

    assert predictor.upcoming(exact, lambda mb: 3.0) == [2, 1] and asked == [1, 0]  # the bound reaches both
    asked.clear()
    # a bound below the time left: the exact copy time is never asked, and the answer is the same as without
    assert predictor.upcoming(exact, lambda mb: 5.0 if mb == 1 else 1.0) == [2, 1] and asked == [1]
    assert predictor.upcoming(exact) == [2, 1]


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank (no fake backend) for stage-level tests."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _one_stage_run(policies, manager_on: bool, micro_batches: int = 4):
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, micro_batches, loss_fn=spec.loss_fn())
    manager = handle = None
    if manager_on:
        manager = make_manager(model, policies)
        handle = install_on_stage(stage, manager)
    torch.manual_seed(9)
    grads = []
    for step in range(2):
        x, y = spec.batch(step, 2 * micro_batches, 0)
        schedule.step(x, target=y)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return stage, manager, handle, grads


def test_install_on_stage_uses_chunk_ids_and_skips_shape_inference(one_rank_group):
    _, _, _, want = _one_stage_run(None, manager_on=False)
    stage, manager, handle, got = _one_stage_run({0: "S", 1: "R", 2: "S", 3: "D", 4: "R"}, manager_on=True)
    for w, g in zip(want, got):
        assert all(torch.equal(w[k], g[k]) for k in w)
    s = manager.stats()
    # the shape-inference forward of the first step ran outside forward_one_chunk: micro-batches 0-3 only,
    # and every layer saw exactly as many managed forwards as chunks were run
    assert all(set(layer.activation_bytes) == {0, 1, 2, 3} for layer in s.layers.values())
    assert s.layers[1].recomputes == 8 and s.sync_fallbacks == 0 and s.live_saved_storages == 0
    with pytest.raises(RuntimeError, match="already has a vpipe tensor manager"):
        install_on_stage(stage, manager)
    assert "forward_one_chunk" in stage.__dict__
    handle.run_plain(True)  # the stage's own methods back between steps: the manager is still installed
    assert "forward_one_chunk" not in stage.__dict__
    with pytest.raises(RuntimeError, match="already has a vpipe tensor manager"):
        install_on_stage(stage, manager)
    handle.remove()
    assert not {"forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
                "_vpipe_tensor_manager"} & set(stage.__dict__)
    install_on_stage(stage, manager).remove()  # removed: a manager may be installed again
    with pytest.raises(TypeError, match="needs a torch.distributed.pipelining stage"):
        install_on_stage(nn.Linear(2, 2), manager)  # type: ignore[arg-type]


def test_swap_outs_go_as_one_copy_batch_per_layer_call_and_the_cap_splits_them():
    """The per-tensor stream switch and events dominated small copies on a GPU: one batch per layer call."""
    torch.manual_seed(0)
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    x, _ = spec.batch(0, 4, 0)
    for batch_bytes, expect_one_per_layer in ((1 << 30, True), (1, False)):
        manager = make_manager(model, dict.fromkeys(range(len(model)), Policy.SWAP))
        manager._engine.batch_bytes = batch_bytes
        batches: list[int] = []
        engine_copy = manager._copies.to_host_batch
        def counting_copy(pairs, batches=batches, engine_copy=engine_copy):
            batches.append(len(pairs))
            return engine_copy(pairs)

        manager._copies.to_host_batch = counting_copy
        with manager.micro_batch(0):
            out = model(x)
        swapped = manager.stats().d2h_bytes
        out.float().sum().backward()
        assert swapped > 0 and sum(batches) > len(model)
        if expect_one_per_layer:
            assert len(batches) == len(model) and max(batches) > 1  # every layer saves several storages
        else:
            assert batches == [1] * sum(batches)  # a 1-byte cap issues every copy at once
        manager.close()
