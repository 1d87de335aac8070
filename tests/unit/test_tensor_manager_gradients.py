"""Keep, swap and recompute must give the same gradients bit for bit (dropout on)."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from torch import nn
from torch.func import functional_call

from support.tensor_manager import (
    assert_grads_equal,
    gpipe_step,
    layers_of,
    make_manager,
    model_spec,
    train_grads,
)
from vpipe.plan import Plan, Policy
from vpipe_lab.runtime.models import build_model

MODELS = ["transformer", "cnn"]


def _all(kind: str, policy: Policy) -> dict[int, Policy]:
    return {lid: policy for lid in range(len(model_spec(kind).layers))}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("scenario", ["D", "S", "R", "mix0", "mix1"])
def test_policies_give_the_gradients_of_no_manager(kind, scenario):
    want, _ = train_grads(kind, None)
    if scenario.startswith("mix"):
        rng = random.Random(int(scenario[-1]))
        policies = {lid: rng.choice(list(Policy)) for lid in range(len(model_spec(kind).layers))}
        assert len(set(policies.values())) > 1
    else:
        policies = _all(kind, Policy(scenario))
    got, manager = train_grads(kind, policies)
    assert_grads_equal(got, want)
    stats = manager.stats()
    if scenario == "S":
        assert stats.d2h_bytes > 0 and stats.h2d_bytes >= stats.d2h_bytes
    if scenario == "R":
        assert stats.recompute_s > 0 and stats.d2h_bytes == 0
        assert all(layer.recomputes > 0 for layer in stats.layers.values())
    assert stats.live_saved_storages == 0 and stats.resident_bytes == 0 and stats.host_pool_used_bytes == 0


@pytest.mark.parametrize("policy", ["D", "S"])
def test_a_graph_dropped_without_its_backward_frees_every_storage_without_the_garbage_collector(policy):
    """A saved output is saved by its own node (softmax's, here): a hook holding it with its grad_fn makes a
    cycle that only the garbage collector breaks, and the saved activations would outlive the graph."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, _all("transformer", Policy(policy)))
    x, y = spec.batch(0, 4, 0)
    gc.collect()
    gc.disable()
    try:
        with manager.micro_batch(0):
            loss = spec.loss_fn()(model(x), y)
        assert manager.stats().live_saved_storages > 0
        del loss  # an evaluation with grad on, or a step abandoned on an exception
        assert manager.stats().live_saved_storages == 0 and manager.stats().resident_bytes == 0
    finally:
        gc.enable()
    manager.close()


@pytest.mark.parametrize("policies", [{0: "D", 1: "R"}, {0: "R", 1: "R"}, {0: "S", 1: "R"}])
def test_a_recomputed_layer_gets_its_inputs_asking_for_grad_as_its_forward_did(policies):
    """Autograd saves only what the asked-for gradients need: a Linear whose input needs no grad saves no
    weight for it. The recompute must run on inputs that ask for grad exactly as the forward's did, or it
    saves other tensors than the forward and the backward fails."""
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)))

    x = torch.randn(3, 6)
    want = build()
    want(x).square().sum().backward()
    model = build()
    manager = make_manager(model, policies)
    with manager.micro_batch(0):
        out = model(x)
    with manager.backward(0):
        out.square().sum().backward()
    assert manager.stats().layers[1].recomputes == 1
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        assert torch.equal(p.grad, q.grad), name
    manager.close()


@pytest.mark.parametrize("autocast_in", ["forward", "backward"])
def test_a_recompute_runs_under_the_autocast_of_its_forward(autocast_in):
    """Under CPU autocast a Linear computes in bfloat16: the recompute must too, and must not when the
    forward ran without autocast but the backward runs inside it."""
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)))

    def autocast(phase: str) -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=phase == autocast_in)

    x = torch.randn(3, 8)
    want = build()
    with autocast("forward"):
        out = want(x)
    with autocast("backward"):
        out.float().square().sum().backward()
    model = build()
    manager = make_manager(model, {0: "R", 1: "R"})
    with manager.micro_batch(0), autocast("forward"):
        out = model(x)
    with manager.backward(0), autocast("backward"):
        out.float().square().sum().backward()
    assert manager.stats().layers[1].recomputes == 1
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        assert torch.equal(p.grad, q.grad), name
    manager.close()


def test_dropout_is_really_on():
    """Guard: two runs with different seeds differ, so equal gradients above mean equal masks."""
    a, _ = train_grads("transformer", None, seed=1)
    b, _ = train_grads("transformer", None, seed=2)
    assert any(not torch.equal(a[0][k], b[0][k]) for k in a[0])


@pytest.mark.parametrize("kind", MODELS)
def test_policy_changes_between_micro_batches_keep_gradients_exact(kind):
    want, _ = train_grads(kind, None, steps=3)
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    manager = make_manager(model)
    cycle = list(Policy)
    changes = 0

    def change(mb: int) -> None:
        nonlocal changes
        changes += 1
        for lid in manager.layer_ids:
            manager.set_policy(lid, cycle[(lid + changes) % 3])

    torch.manual_seed(11)
    got = []
    for step in range(3):
        # forwards and backwards of one step each see other policies, also in between
        gpipe_step(model, spec, step, manager, before_forward=change, before_backward=change)
        got.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    assert_grads_equal(got, want)
    assert manager.stats().live_saved_storages == 0


def test_string_policies_and_unknown_layers():
    model = build_model(model_spec("cnn"), seed=0)
    manager = make_manager(model, {0: "S", 1: "R"})
    assert manager.policy(0) is Policy.SWAP and manager.policy(1) is Policy.RECOMPUTE
    assert manager.policies()[2] is Policy.KEEP
    with pytest.raises(KeyError, match=r"layer 9 is not managed .* layers \[0, 1, 2, 3, 4\]"):
        manager.set_policy(9, "S")
    with pytest.raises(KeyError, match=r"layers \[7\]"):
        manager.set_policies({7: "D"})
    with pytest.raises(ValueError, match="unknown policy 'X'"):
        manager.set_policy(0, "X")


def test_a_plan_sets_the_policies_of_this_stage_only():
    model = build_model(model_spec("cnn"), seed=0)
    manager = make_manager(model, {4: "S"})
    plan = Plan(epoch=1, stages=((0, 1, 2, 3, 4), (5, 6)), policies={1: Policy.RECOMPUTE, 2: Policy.SWAP,
                                                                    6: Policy.SWAP})
    manager.apply_plan(plan)
    assert manager.policies() == {0: Policy.KEEP, 1: Policy.RECOMPUTE, 2: Policy.SWAP, 3: Policy.KEEP,
                                  4: Policy.KEEP}


def test_stashed_weights_under_functional_call_are_neither_swapped_nor_counted():
    """PipeDream runs the stage on stashed weight tensors (plain leaves, not Parameters)."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    x, y = spec.batch(0, 2, 0)
    stash = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}

    def run(use_stash: bool, policies):
        manager = make_manager(model, policies)
        torch.manual_seed(5)
        with manager.micro_batch(0):
            out = functional_call(model, stash, (x,)) if use_stash else model(x)
        loss = spec.loss_fn()(out, y)
        with manager.backward(0):
            loss.backward()
        stats = manager.stats()
        manager.close()
        return stats

    swap_all = {lid: Policy.SWAP for lid in layers_of(model)}
    plain = run(False, swap_all)
    stashed = run(True, swap_all)
    # the same activations were swapped: not one byte of the stashed weights
    assert stashed.d2h_bytes == plain.d2h_bytes > 0
    assert stashed.weight_tensors_skipped == plain.weight_tensors_skipped > 0
    assert {k: v.activation_bytes for k, v in stashed.layers.items()} == {
        k: v.activation_bytes for k, v in plain.layers.items()}
    # and the gradients went to the stash, equal to the live parameters' gradients
    for name, p in model.named_parameters():
        assert torch.equal(stash[name].grad, p.grad), name


def test_recompute_uses_the_weights_of_its_forward():
    """A layer recomputed after the live weights changed must use the (stashed) weights it ran with."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    x, y = spec.batch(0, 2, 0)

    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    def grads(policy: Policy) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(initial[n])
        stash = {n: t.clone().requires_grad_() for n, t in initial.items()}
        manager = make_manager(model, {lid: policy for lid in layers_of(model)})
        torch.manual_seed(3)
        with manager.micro_batch(0):
            out = functional_call(model, stash, (x,))
        with torch.no_grad():  # an optimizer step happens before this micro-batch's backward
            for p in model.parameters():
                p.add_(1.0)
        with manager.backward(0):
            spec.loss_fn()(out, y).backward()
        manager.close()
        return {n: t.grad for n, t in stash.items()}

    kept, recomputed = grads(Policy.KEEP), grads(Policy.RECOMPUTE)
    for name in kept:
        assert torch.equal(kept[name], recomputed[name]), name


def test_layer_with_buffers_keeps_them():
    """BatchNorm's running statistics are buffers: never swapped, never counted as activations."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 1, 8, 8)
    ref = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    ref.load_state_dict(model.state_dict())
    ref(x).sum().backward()
    manager = make_manager(model, {0: "S", 1: "S", 2: "S"})
    with manager.micro_batch(0):
        out = model(x)
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert buffers > 0
    with manager.backward(0):
        out.sum().backward()
    stats = manager.stats()
    assert stats.d2h_bytes == sum(s.activation_bytes_per_micro_batch for s in stats.layers.values())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(model[1].running_mean, ref[1].running_mean)


def test_a_recomputed_batchnorm_leaves_its_statistics_as_the_forwards_left_them():
    """The replay runs on the buffers' values at its call and puts back their values now: with two
    micro-batches' forwards before the backwards, the statistics stay those of the second forward, also
    when the first micro-batch's backward (its replay updating them again) runs last."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    ref = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    ref.load_state_dict(model.state_dict())
    xs = [torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8)]
    ref_outs = [ref(x) for x in xs]
    for out in reversed(ref_outs):
        out.sum().backward()
    manager = make_manager(model, {0: "R", 1: "R", 2: "R"})
    outs = []
    for mb, x in enumerate(xs):
        with manager.micro_batch(mb):
            outs.append(model(x))
    for mb in (1, 0):
        with manager.backward(mb):
            outs[mb].sum().backward()
    assert manager.stats().layers[1].recomputes == 2
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), name
    manager.close()
