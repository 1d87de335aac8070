"""Split backwards (zero bubble): input gradients first, weight gradients later, in one process.

The stage runs torch's own ``stage_backward_input`` / ``stage_backward_weight`` (what
``backward_one_chunk(full_backward=False)`` and ``backward_weight_one_chunk`` call) in an
order where weight passes lag behind input passes. Swapped storages must be brought back
once for both passes, recomputed layers recomputed once per call, gradients bitwise those
of a run without the manager, and nothing left behind.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from support.tensor_manager import assert_grads_equal, make_manager, model_spec
from vpipe.plan import Policy
from vpipe.tensor_manager import TensorManager
from vpipe_lab.runtime.models import build_model

# the stage: three transformer blocks and the head / the CNN's conv blocks and head (float inputs)
STAGE_LAYERS = {"transformer": [1, 2, 3, 4], "cnn": [1, 2, 3, 4]}
MIX = {1: "S", 2: "R", 3: "D", 4: "S"}


def _order(micro_batches: int, lag: int) -> list[tuple[str, int]]:
    """Forwards, input passes one behind, weight passes ``lag`` behind the input passes (then drained)."""
    order: list[tuple[str, int]] = []
    for step in range(micro_batches + 1 + lag):
        if step < micro_batches:
            order.append(("F", step))
        if 0 <= step - 1 < micro_batches:
            order.append(("I", step - 1))
        if 0 <= step - 1 - lag < micro_batches:
            order.append(("W", step - 1 - lag))
    return order


def _stage_input(kind: str, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage input (what the previous stage sent) and the gradient of the stage output."""
    gen = torch.Generator().manual_seed(100 + mb)
    if kind == "transformer":
        x = torch.randn(2, 16, 32, generator=gen)
        g = torch.randn(2, 16, 256, generator=gen)
    else:
        x = torch.randn(2, 8, 16, 16, generator=gen)
        g = torch.randn(2, 256, generator=gen)
    return x, g


def split_run(kind: str, policies: Mapping[int, str] | None, order: list[tuple[str, int]], *,
              manager: TensorManager | None = None, model: torch.nn.Sequential | None = None,
              budget_bytes: int | None = None, watch=None) -> tuple[dict, TensorManager | None]:
    """Run ``order`` on the stage; returns the input gradients per micro-batch and the weight gradients."""
    spec = model_spec(kind)
    if model is None:
        model = build_model(spec, seed=0)
    if manager is None and policies is not None:
        manager = make_manager(model, policies, budget_bytes=budget_bytes)
    stage = torch.nn.Sequential(*[model[i] for i in STAGE_LAYERS[kind]])
    state: dict[int, tuple] = {}
    grads: dict[str, torch.Tensor] = {}
    for action, mb in order:
        if action == "F":
            x, g = _stage_input(kind, mb)
            inp = x.requires_grad_()
            torch.manual_seed(1000 + mb)  # dropout: the same masks with and without the manager
            if manager is None:
                out = stage(inp)
            else:
                with manager.micro_batch(mb):
                    out = stage(inp)
            loss = (out * g).sum()  # the last stage's loss, computed outside the forward as the schedules do
            state[mb] = (inp, loss)
        elif action == "I":
            inp, loss = state[mb]
            if manager is None:
                dinputs, groups = stage_backward_input([loss], None, [inp], stage.parameters())
            else:
                with manager.backward(mb, "input"):
                    dinputs, groups = stage_backward_input([loss], None, [inp], stage.parameters())
            grads[f"input.{mb}"] = dinputs[0]
            state[mb] = (groups,)
        else:
            (groups,) = state.pop(mb)
            if manager is None:
                stage_backward_weight(stage.parameters(), groups)
            else:
                with manager.backward(mb, "weight"):
                    stage_backward_weight(stage.parameters(), groups)
            del groups
        if watch is not None and manager is not None:
            watch(action, mb, manager)
    grads.update({n: p.grad.clone() for n, p in stage.named_parameters()})
    return grads, manager


def _policies(kind: str, which: str) -> dict[int, str]:
    if which == "mix":
        return dict(MIX)
    return {lid: which for lid in STAGE_LAYERS[kind]}


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
@pytest.mark.parametrize("which", ["S", "R", "mix"])
def test_split_backward_fetches_once_recomputes_once_and_stays_exact(kind, which):
    order = _order(micro_batches=4, lag=2)
    want, _ = split_run(kind, None, order)
    lagging = []

    def watch(action, mb, manager):
        if action == "I":
            lagging.append(manager.stats())

    got, manager = split_run(kind, _policies(kind, which), order, watch=watch)
    assert_grads_equal([got], [want])  # input gradients of every micro-batch and weight gradients, bitwise
    s = manager.stats()
    swapped = [lid for lid, p in s.policies.items() if p is Policy.SWAP]
    recomputed = [lid for lid, p in s.policies.items() if p is Policy.RECOMPUTE]
    if swapped:
        assert s.d2h_bytes > 0
        # brought back once, all of it for the input pass: the weight pass found what it needed on the device
        assert s.h2d_bytes == s.d2h_bytes and s.refetched_bytes == 0
        assert s.h2d_bytes_by_phase == {"input": s.d2h_bytes}
        assert s.multi_phase_storages > 0
        for lid in swapped:
            assert s.layers[lid].h2d_bytes == s.layers[lid].d2h_bytes > 0
    for lid in recomputed:
        # one recompute per layer call, serving the input pass and the (lagging) weight pass
        assert s.layers[lid].recompute_calls == 4 and s.layers[lid].recomputes == 4
    assert s.repeat_recomputes == 0 and s.sync_fallbacks == 0
    # between the passes only what the weight pass unpacks again is held: less than the layers saved
    assert all(m.lag_resident_bytes > 0 for m in lagging)
    for lid in swapped + recomputed:
        assert 0 < s.layers[lid].lag_bytes <= s.layers[lid].activation_bytes_per_micro_batch
        if kind == "transformer" and lid != 4:  # attention and GELU save much only the input pass needs
            assert s.layers[lid].lag_bytes < s.layers[lid].activation_bytes_per_micro_batch / 2
    # nothing left behind
    assert s.resident_bytes == 0 and s.live_saved_storages == 0 and s.host_pool_used_bytes == 0
    assert s.lag_resident_bytes == 0 and s.lag_dropped == 0


def test_what_the_weight_pass_needs_is_exactly_what_is_kept():
    """Transformer block: the inputs of the Linear layers and LayerNorms stay, attention's internals go."""
    order = [("F", 0), ("I", 0), ("W", 0)]
    seen = {}

    def watch(action, mb, manager):
        if action == "I":
            seen["between"] = manager.stats()

    _, manager = split_run("transformer", {1: "S", 2: "D", 3: "D", 4: "D"}, order, watch=watch)
    between = seen["between"].layers[1]
    x, _ = _stage_input("transformer", 0)
    activation = x.numel() * 4  # one (batch, sequence, d_model) float tensor
    stats = x.shape[0] * x.shape[1] * 4  # LayerNorm's mean or rstd
    # measured (torch 2.13): the weight pass unpacks ln1's and ln2's input, mean and rstd and the inputs of
    # qkv, proj, fc and out (out's is d_ff = 4 d_model wide); not q, k, v, the scores, the softmax, the
    # masks of dropout and causality or GELU's input, which only the input pass needs
    assert between.lag_bytes == 2 * (activation + 2 * stats) + 3 * activation + 4 * activation
    assert between.lag_bytes < between.activation_bytes_per_micro_batch / 2
    after = manager.stats().layers[1]
    assert after.h2d_bytes == after.d2h_bytes


def test_first_stage_deferred_backward_is_one_full_pass():
    """Torch's first stage does nothing in the input call and everything in the weight call."""
    spec = model_spec("transformer")
    model = build_model(spec, seed=0)
    manager = make_manager(model, {lid: "S" for lid in range(5)})
    x, y = spec.batch(0, 2, 0)
    with manager.micro_batch(0):
        loss = spec.loss_fn()(model(x), y)
    with manager.backward(0, "full"):  # what install_on_stage opens for the first stage's weight call
        loss.backward()
    s = manager.stats()
    assert s.h2d_bytes == s.d2h_bytes and s.h2d_bytes_by_phase == {"full": s.d2h_bytes}
    assert s.live_saved_storages == 0 and s.host_pool_used_bytes == 0


def test_retain_graph_full_passes_still_recompute_each_pass():
    """Two plain backward passes over a retained graph: each recomputes, as checkpoint does (a repeat)."""
    spec = model_spec("cnn")
    x, y = spec.batch(0, 2, 0)
    model = build_model(spec, seed=0)
    manager = make_manager(model, {1: "R", 2: "S"})
    with manager.micro_batch(0):
        loss = spec.loss_fn()(model(x), y)
    with manager.backward(0):
        loss.backward(retain_graph=True)
    with manager.backward(0):
        loss.backward()
    s = manager.stats()
    assert s.layers[1].recompute_calls == 1 and s.layers[1].recomputes == 2 and s.repeat_recomputes == 1
    assert s.refetched_bytes == s.d2h_bytes > 0  # the second pass fetched again
    assert s.live_saved_storages == 0 and s.resident_bytes == 0


def _peak_all_kept_split(kind: str, order) -> int:
    _, manager = split_run(kind, {lid: "D" for lid in STAGE_LAYERS[kind]}, order)
    return manager.stats().peak_resident_bytes


@pytest.mark.parametrize("which", ["S", "R", "mix", "D"])
def test_budget_holds_while_weight_passes_lag(which, caplog):
    """Weight passes three micro-batches behind: what lagging micro-batches hold is counted and fits."""
    kind = "transformer"
    order = _order(micro_batches=6, lag=3)
    budget = int(0.45 * _peak_all_kept_split(kind, order))
    spec = model_spec(kind)
    want_model = build_model(spec, seed=0)
    model = build_model(spec, seed=0)
    manager = make_manager(model, _policies(kind, which), budget_bytes=budget)
    steps, lag_held = [], []

    def watch(action, mb, m):
        lag_held.append(m.stats().lag_resident_bytes)

    with caplog.at_level(logging.INFO, logger="vpipe.decisions"):
        for _ in range(3):
            before = manager.stats()
            want, _ = split_run(kind, None, order, model=want_model)
            got, _ = split_run(kind, None, order, manager=manager, model=model, watch=watch)
            assert_grads_equal([got], [want])
            want_model.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            after = manager.stats()
            steps.append({"peak": after.peak_resident_bytes,
                          "dropped": after.lag_dropped - before.lag_dropped,
                          "refetched": after.refetched_bytes - before.refetched_bytes,
                          "repeats": after.repeat_recomputes - before.repeat_recomputes})
            manager.reset_peak()
    assert all(0 < step["peak"] <= budget for step in steps), (steps, budget)
    assert max(lag_held) > 0  # micro-batches did hold bytes for their weight passes
    # the first step measures what a lagging micro-batch holds; from then on the
    # projection counts it (escalating where needed), so nothing kept for a
    # weight pass has to be dropped, fetched or recomputed again
    assert all(step["dropped"] == step["refetched"] == step["repeats"] == 0 for step in steps[1:]), steps
    dropped = [r for r in caplog.records if getattr(r, "vpipe_fields", {}).get("event") == "weight_pass_drop"]
    assert bool(dropped) == (steps[0]["dropped"] > 0)
    s = manager.stats()
    assert s.resident_bytes == 0 and s.live_saved_storages == 0 and s.host_pool_used_bytes == 0
    if which == "D":
        assert s.escalations


def test_the_projection_counts_what_lagging_micro_batches_hold():
    """kept_bytes adds a swapped or recomputed layer's lag bytes, spread over the micro-batches in flight."""
    from vpipe.tensor_manager.budget import LayerEstimate, fit_micro_batch, kept_bytes

    e = LayerEstimate(0, Policy.SWAP, activation_bytes=1000, swappable_bytes=900, input_bytes=200,
                      forward_s=1.0,
                      lag_bytes=300, lag_share=0.5)
    assert kept_bytes(e, Policy.KEEP) == 1000  # autograd holds everything until the weight pass anyway
    assert kept_bytes(e, Policy.SWAP) == 100 + 150
    assert kept_bytes(e, Policy.RECOMPUTE) == 200 + 150
    common = {"budget_bytes": 9800, "resident_bytes": 0, "reserve_bytes": 1000, "in_flight": 4,
              "pool_free_bytes": 1 << 30, "swap_s_per_byte": 1e-9, "overlap": 0.0, "context": "test"}
    # room per micro-batch (9800 - 1000) / 4 = 2200 for three layers of 1000: one swap (2100) fits ...
    kept = [LayerEstimate(i, Policy.KEEP, 1000, 900, 200, 1.0, lag_bytes=300) for i in range(3)]
    assert [c.new for c in fit_micro_batch(kept, **common)] == [Policy.SWAP]
    # ... but not with half the micro-batches in flight waiting for their weight pass (2250): two swaps
    lagging = [LayerEstimate(i, Policy.KEEP, 1000, 900, 200, 1.0, lag_bytes=300, lag_share=0.5)
               for i in range(3)]
    assert [c.new for c in fit_micro_batch(lagging, **common)] == [Policy.SWAP, Policy.SWAP]


def test_budget_drops_what_a_lagging_weight_pass_holds_when_it_must():
    """A budget the lag cannot be kept under: kept copies are dropped, fetched again, counted and logged."""
    kind = "transformer"
    order = _order(micro_batches=4, lag=3)
    want, _ = split_run(kind, None, order)
    spec = model_spec(kind)
    model = build_model(spec, seed=0)
    budget = int(0.3 * _peak_all_kept_split(kind, order))
    manager = make_manager(model, {lid: "S" for lid in STAGE_LAYERS[kind]}, budget_bytes=budget)
    got, _ = split_run(kind, None, order, manager=manager, model=model)
    assert_grads_equal([got], [want])
    s = manager.stats()
    assert s.peak_resident_bytes <= budget
    assert s.lag_dropped > 0 and s.refetched_bytes > 0
    assert s.h2d_bytes == s.d2h_bytes + s.refetched_bytes
    assert s.live_saved_storages == 0 and s.host_pool_used_bytes == 0
