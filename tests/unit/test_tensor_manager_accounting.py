"""What the manager counts: activation bytes, resident and peak bytes, copies, storages copied once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from support.tensor_manager import assert_grads_equal, gpipe_step, layers_of, make_manager, model_spec
from vpipe.plan import Policy
from vpipe.tensor_manager import TensorManager
from vpipe.tensor_manager.accounting import count_saved_bytes
from vpipe_lab.runtime.models import build_model


def _forward_all(kind: str, policies=None, micro_batches: int = 3, **kwargs):
    """Forwards of ``micro_batches`` micro-batches under a manager, no backward yet."""
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    manager = make_manager(model, policies, **kwargs)
    x, y = spec.batch(0, 2 * micro_batches, 0)
    torch.manual_seed(0)
    losses = []
    for mb, (xm, ym) in enumerate(zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches))):
        with manager.micro_batch(mb):
            out = model(xm.clone())  # its own storage: views of one input would be one saved storage
        losses.append(spec.loss_fn()(out, ym))
    return model, manager, losses


def _backward_all(manager, losses):
    for mb, loss in enumerate(losses):
        with manager.backward(mb):
            loss.backward()


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_activation_bytes_match_an_independent_count(kind):
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    x, _ = spec.batch(0, 2, 0)
    torch.manual_seed(0)
    want, h = {}, x
    for lid, layer in layers_of(model).items():
        with count_saved_bytes(layer) as counter:
            h = layer(h)
        want[lid] = counter.bytes
    manager = make_manager(model)
    torch.manual_seed(0)
    with manager.micro_batch(0):
        model(x)
    got = {lid: s.activation_bytes for lid, s in manager.stats().layers.items()}
    assert got == {lid: {0: n} for lid, n in want.items()}
    assert all(n > 0 for n in want.values())


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_resident_and_peak_bytes_follow_the_forwards_and_backwards(kind):
    model, manager, losses = _forward_all(kind)
    stats = manager.stats()
    per_layer_sum = sum(n for s in stats.layers.values() for n in s.activation_bytes.values())
    assert stats.resident_bytes == stats.peak_resident_bytes > 0
    assert sum(s.resident_bytes for s in stats.layers.values()) == stats.resident_bytes
    if kind == "transformer":  # blocks do not save their outputs: no storage is shared between layers
        assert stats.resident_bytes == per_layer_sum
    else:  # a conv block's ReLU saves its output, the next conv saves it as input: counted once
        assert stats.resident_bytes < per_layer_sum
    _backward_all(manager, losses)
    after = manager.stats()
    assert after.resident_bytes == 0 and after.live_saved_storages == 0
    assert after.peak_resident_bytes == stats.peak_resident_bytes
    manager.reset_peak()
    assert manager.stats().peak_resident_bytes == 0


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_a_storage_saved_several_times_is_copied_once(kind):
    _, kept, _ = _forward_all(kind)
    model, swapped, losses = _forward_all(kind, {lid: "S" for lid in range(len(model_spec(kind).layers))})
    s = swapped.stats()
    # every distinct storage went to the host exactly once (q/k/v views of one qkv, ReLU outputs)
    assert s.d2h_bytes == kept.stats().peak_resident_bytes
    assert s.resident_bytes == 0 and s.host_pool_used_bytes >= s.d2h_bytes
    _backward_all(swapped, losses)
    s = swapped.stats()
    assert s.h2d_bytes == s.d2h_bytes  # each storage came back once, though several tensors used it
    assert s.host_pool_used_bytes == 0 and s.sync_fallbacks == 0 and s.prefetched > 0


def test_tensors_under_the_swap_threshold_stay_on_the_device():
    swap_all = {lid: "S" for lid in range(5)}
    _, everything, _ = _forward_all("transformer", swap_all, min_swap_bytes=0)
    total = everything.stats().d2h_bytes
    _, nothing, _ = _forward_all("transformer", swap_all, min_swap_bytes=1 << 30)
    assert nothing.stats().d2h_bytes == 0 and nothing.stats().resident_bytes == total
    _, some, _ = _forward_all("transformer", swap_all, min_swap_bytes=8 * 1024)
    s = some.stats()
    assert 0 < s.d2h_bytes < total
    assert s.d2h_bytes + s.resident_bytes == total


def test_forwards_outside_a_micro_batch_or_inside_a_backward_are_not_managed():
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, {1: "S", 2: "R"})
    x, y = spec.batch(0, 2, 0)
    out = model(x)  # like pipelining's shape inference: no micro-batch
    assert manager.stats().live_saved_storages == 0
    assert all(not s.activation_bytes for s in manager.stats().layers.values())
    with manager.backward(0):
        model(x)  # a forward run from inside a backward (a recompute) is not counted either
    assert manager.stats().live_saved_storages == 0
    spec.loss_fn()(out, y).backward()  # the unmanaged graph still trains
    assert all(p.grad is not None for p in model.parameters())


def test_sync_fallbacks_count_unpacks_without_a_prefetch():
    model, manager, losses = _forward_all("transformer", {lid: "S" for lid in range(5)}, micro_batches=2)
    swapped = manager.stats().live_saved_storages
    losses[0].backward()  # no backward() context and no prefetch: every storage is copied on demand
    assert manager.stats().sync_fallbacks == swapped // 2
    manager.prefetch(1)  # an explicit prefetch before the backward: nothing left to copy on demand
    before = manager.stats()
    losses[1].backward()
    after = manager.stats()
    assert after.sync_fallbacks == before.sync_fallbacks
    assert after.prefetched > 0 and after.live_saved_storages == 0


def test_double_unpack_fetches_once_and_frees_swapped_storage_after_the_last_pass():
    """Zero-bubble backward: input gradients (retain_graph), later weight gradients."""
    spec = model_spec("transformer")
    ref_model = build_model(spec, seed=0)
    model = build_model(spec, seed=0)
    blocks = [1, 2]
    x = torch.randn(2, 16, 32)
    g = torch.randn(2, 16, 32)

    def run(m, manager):
        inp = x.clone().requires_grad_()
        torch.manual_seed(4)
        sub = torch.nn.Sequential(*[m[i] for i in blocks])
        if manager is None:
            out = sub(inp)
            out.backward(g)
            return inp.grad, {n: p.grad for n, p in sub.named_parameters()}
        with manager.micro_batch(0):
            out = sub(inp)
        with manager.backward(0, "input"):
            dinputs, groups = stage_backward_input([out], [g], [inp], sub.parameters())
        mid = manager.stats()
        assert mid.host_pool_used_bytes > 0 and mid.live_saved_storages > 0  # kept for the weight pass
        # on the device between the passes: only what the weight pass unpacks again, counted as resident
        assert 0 < mid.resident_bytes == mid.lag_resident_bytes < mid.d2h_bytes
        with manager.backward(0, "weight"):
            stage_backward_weight(sub.parameters(), groups)
        del groups
        return dinputs[0], {n: p.grad for n, p in sub.named_parameters()}

    want_dx, want = run(ref_model, None)
    manager = make_manager(model, {1: "S", 2: "S"})
    got_dx, got = run(model, manager)
    assert torch.equal(got_dx, want_dx)
    assert_grads_equal([got], [want])
    s = manager.stats()
    assert s.multi_phase_storages > 0 and s.host_pool_used_bytes == 0 and s.live_saved_storages == 0
    assert s.h2d_bytes == s.d2h_bytes and s.refetched_bytes == 0  # brought back once, for both passes


def test_retain_graph_backward_twice_gives_the_same_gradients():
    spec = model_spec("cnn")
    x, y = spec.batch(0, 2, 0)
    results = []
    for policies in (None, {lid: p for lid, p in enumerate(["S", "R", "S", "D", "S"])}):
        model = build_model(spec, seed=0)
        manager = make_manager(model, policies or {})
        with manager.micro_batch(0):
            loss = spec.loss_fn()(model(x), y)
        with manager.backward(0):
            loss.backward(retain_graph=True)
        with manager.backward(0):
            loss.backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert manager.stats().live_saved_storages == 0
    assert_grads_equal([results[1]], [results[0]])


def test_per_layer_copy_and_recompute_statistics():
    model, manager, losses = _forward_all("transformer", {1: "S", 2: "R", 3: "D"})
    _backward_all(manager, losses)
    s = manager.stats()
    assert (
        s.layers[1].d2h_bytes > 0 and s.layers[1].h2d_bytes == s.layers[1].d2h_bytes and s.layers[1].d2h_s > 0
    )
    assert s.layers[2].recomputes >= 3 and s.layers[2].recompute_s > 0 and s.layers[2].d2h_bytes == 0
    assert s.layers[2].input_bytes and s.layers[2].input_bytes < s.layers[2].activation_bytes_per_micro_batch
    assert s.layers[3].d2h_bytes == 0 and s.layers[3].recomputes == 0
    assert s.d2h_bytes == sum(layer.d2h_bytes for layer in s.layers.values())
    assert all(layer.forward_s and layer.forward_s > 0 for layer in s.layers.values())
    assert manager.layer_saved_bytes() == {lid: layer.activation_bytes_per_micro_batch
                                           for lid, layer in s.layers.items()}
    assert s.policies == {0: Policy.KEEP, 1: Policy.SWAP, 2: Policy.RECOMPUTE, 3: Policy.KEEP, 4: Policy.KEEP}


def test_gpipe_step_helper_really_runs_every_micro_batch():
    """Guard for the helper the gradient tests rely on."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model)
    losses = gpipe_step(model, spec, 0, manager, micro_batches=4)
    assert len(losses) == 4
    assert all(set(s.activation_bytes) == {0, 1, 2, 3} for s in manager.stats().layers.values())


def test_a_micro_batch_kept_bytes_count_a_tensor_two_layers_save_once_and_are_forgotten_when_layers_change():
    # layer 0 ends in a ReLU, which saves its output; layer 1's Linear saves that same tensor as its input
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 256), nn.ReLU()), nn.Linear(256, 64))
    manager = TensorManager({0: model[0], 1: model[1]}, device="cpu")
    x = torch.randn(32, 64, requires_grad=True)
    with manager.micro_batch(0):
        loss = model(x).sum()
    summary = manager.summary()
    per_layer = summary["activation_bytes"]
    shared = 32 * 256 * 4  # the ReLU's output, saved by both layers
    assert per_layer[1] == shared and per_layer[0] >= shared + x.numel() * 4
    assert summary["kept_bytes_per_mb"] == per_layer[0] + per_layer[1] - shared == manager.ledger.resident
    with manager.backward(0):
        loss.backward()
    manager.add_layer(2, nn.Linear(64, 64))  # not measured with the layers it has now
    assert manager.summary()["kept_bytes_per_mb"] == 0


def test_the_step_peak_restarts_without_touching_the_runs_peak():
    from vpipe.tensor_manager.accounting import Ledger

    ledger = Ledger()
    ledger.add(0, 0, 100)
    ledger.sub(0, 0, 100)
    ledger.reset_step_peak()  # per-step metrics read and restart it; memory reports read the run's peak
    ledger.add(0, 1, 40)
    assert (ledger.peak, ledger.step_peak) == (100, 40)
    ledger.add_micro_batch(2, [(0, 80)])
    assert (ledger.peak, ledger.step_peak) == (120, 120)


class _ReducedScale(nn.Module):
    """A layer with a buffer whose output is scaled by an all-reduce it does not wait on: the scale, a
    leaf ``AsyncCollectiveTensor`` that needs no gradient, is saved for the backward (as a tensor-parallel
    MoE block saves its experts' ``RowwiseParallel`` outputs; fuzzer seeds 227 and 247)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        scale = funcol.all_reduce(torch.full((4,), 2.0), "sum", dist.group.WORLD)
        return self.lin(x) * scale


@pytest.mark.parametrize("policy", ["D", "S", "R"])
def test_a_pending_collectives_result_saved_for_backward_is_counted_by_the_memory_it_wraps(policy):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(_ReducedScale(), _ReducedScale())
        plain = copy.deepcopy(model)
        manager = make_manager(model, {0: policy, 1: policy})
        x = torch.randn(3, 4)
        with manager.micro_batch(0):
            out = model(x)  # its saved scale wraps storage: asking the wrapper raised before
        with manager.backward(0):
            out.sum().backward()
        plain(x).sum().backward()
        grads = [{n: p.grad for n, p in m.named_parameters()} for m in (model, plain)]
        assert_grads_equal(grads[:1], grads[1:])
    finally:
        dist.destroy_process_group()
