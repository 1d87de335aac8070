"""The stage monitor on plain modules: what it measures, when, and that it leaves no trace."""

from __future__ import annotations

import time
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from support.monitors import chain
from vpipe.monitors import KeepAllSource, SavedTensorStats, StageMonitor, layers_of
from vpipe.monitors.records import GPU_ONLY_FIELDS


def train_step(model: nn.Module, micro_batches: int = 3, width: int = 32, *,
               first_needs_grad: bool = False) -> None:
    for _ in range(micro_batches):
        x = torch.randn(4, width, requires_grad=first_needs_grad)
        model(x).sum().backward()


def hook_state(module: nn.Module) -> list:
    return [(name, dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
             dict(m._backward_pre_hooks)) for name, m in module.named_modules()]


def test_only_every_kth_iteration_is_measured_and_hooks_exist_only_then():
    model = chain()
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=3)
    assert [monitor.is_sampled(i) for i in range(6)] == [False, False, True, False, False, True]
    records = []
    for it in range(6):
        monitor.begin_iteration(it)
        hooked = any(m._forward_hooks for m in model.children())
        assert hooked == monitor.is_sampled(it)
        train_step(model)
        records.append(monitor.end_iteration())
    assert [r is not None for r in records] == [False, False, True, False, False, True]
    assert [r.iteration for r in records if r] == [2, 5]
    monitor.close()


def test_record_has_per_layer_times_bytes_and_memory():
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    monitor = StageMonitor(layers_of(model), stage_index=2, device="cpu", optimizer=opt, sample_every=1)
    train_step(model)  # an unmonitored step first, so momentum buffers exist
    opt.step()
    with monitor.iteration(0) as sample:
        train_step(model, micro_batches=3)
        opt.step()
    record = sample.record
    assert record.stage == 2 and record.iteration == 0 and record.device == "cpu"
    assert record.layer_ids == [5, 6, 7]
    linear_bytes = (32 * 32 + 32) * 4
    for lr in record.layers:
        assert lr.fwd_calls == 3 and lr.bwd_calls == 3
        assert lr.fwd_s > 0 and lr.bwd_s > 0
        assert lr.param_bytes == linear_bytes
        assert lr.optimizer_bytes == linear_bytes  # one momentum buffer per parameter
        # Linear saves its (4, 32) input, Tanh its (4, 32) output; the weight is a parameter
        assert lr.activation_bytes == 2 * 4 * 32 * 4
    assert record.param_bytes == 3 * linear_bytes
    assert record.device_resident_bytes > 0 and record.device_peak_bytes >= record.device_resident_bytes
    assert record.host_rss_bytes > 0
    assert record.step_s >= record.compute_s > 0
    for name in GPU_ONLY_FIELDS:
        assert getattr(record, name) is None
    monitor.close()


def test_first_layer_backward_is_timed_although_its_input_needs_no_grad():
    model = nn.Sequential(OrderedDict([("0", nn.Embedding(50, 16)), ("1", nn.Linear(16, 16))]))
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=1)
    with monitor.iteration(0) as sample:
        for _ in range(2):
            model(torch.randint(0, 50, (4, 8))).sum().backward()
    by_id = {lr.layer_id: lr for lr in sample.record.layers}
    assert by_id[0].bwd_calls == 2 and by_id[0].bwd_s > 0
    assert by_id[1].bwd_calls == 2
    monitor.close()


def test_close_restores_modules_exactly_and_keeps_foreign_hooks():
    model = chain()
    foreign = model[0].register_forward_hook(lambda m, a, o: None)
    before = hook_state(model)
    children = list(model.children())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=1)
    monitor.begin_iteration(0)
    assert hook_state(model) != before
    train_step(model)
    monitor.end_iteration()
    monitor.begin_iteration(1)  # closing in the middle of an iteration must clean up too
    monitor.close()
    assert hook_state(model) == before
    assert list(model.children()) == children
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    foreign.remove()


def test_layers_can_join_and_leave_at_run_time():
    model = chain(ids=(0, 1))
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=1)
    newcomer = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    model.add_module("2", newcomer)
    monitor.add_layer(2, newcomer)
    with monitor.iteration(0) as sample:
        train_step(model)
    assert sample.record.layer_ids == [0, 1, 2]
    assert sample.record.layers[2].fwd_calls == 3
    monitor.begin_iteration(1)
    monitor.remove_layer(0)  # leaving while hooked: its hooks go with it
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
    train_step(model)
    record = monitor.end_iteration()
    assert record.layer_ids == [1, 2]
    with pytest.raises(ValueError, match="already monitored"):
        monitor.add_layer(1, model[1])
    with pytest.raises(KeyError, match="not monitored"):
        monitor.remove_layer(0)
    monitor.close()


def test_recomputation_in_backward_counts_as_backward_not_forward():
    model = chain()
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=1)
    with monitor.iteration(0) as sample:
        for _ in range(2):
            x = torch.randn(4, 32, requires_grad=True)
            h = checkpoint(model[0], x, use_reentrant=False)  # re-runs model[0] in the backward
            model[2](model[1](h)).sum().backward()
    for lr in sample.record.layers:
        assert lr.fwd_calls == 2, lr
    monitor.close()


def test_evaluation_and_suspended_forwards_are_not_measured():
    model = chain()
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=1)
    with monitor.iteration(0) as sample:
        with torch.no_grad():
            model(torch.randn(4, 32))
        with monitor.suspended():
            train_step(model, micro_batches=2)
        train_step(model, micro_batches=1)
    for lr in sample.record.layers:
        assert (lr.fwd_calls, lr.bwd_calls) == (1, 1)
    monitor.close()


class CumulativeSource:
    """A saved-tensor source as the tensor manager reports one: cumulative copy/recompute counters."""

    def __init__(self) -> None:
        self.reading = SavedTensorStats(activation_bytes={5: 111, 6: 222, 7: 333}, host_pool_used_bytes=10,
                                        host_pool_peak_bytes=50, host_pool_capacity_bytes=1000, d2h_bytes=100,
                                        d2h_s=1.0, h2d_bytes=100, h2d_s=1.0, recompute_s=2.0)

    def stats(self) -> SavedTensorStats:
        return self.reading


def test_swap_and_recompute_figures_come_from_the_source_as_differences():
    model = chain()
    source = CumulativeSource()
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=1, saved_source=source)
    with monitor.iteration(0) as sample:
        train_step(model)
        source.reading = SavedTensorStats(activation_bytes={5: 111, 6: 222, 7: 333}, host_pool_used_bytes=20,
                                          host_pool_peak_bytes=700, host_pool_capacity_bytes=1000,
                                          d2h_bytes=612, d2h_s=1.25, h2d_bytes=356, h2d_s=1.5,
                                          recompute_s=2.125)
    r = sample.record
    assert [lr.activation_bytes for lr in r.layers] == [111, 222, 333]
    assert (r.host_pool_used_bytes, r.host_pool_peak_bytes, r.host_pool_capacity_bytes) == (20, 700, 1000)
    assert (r.d2h_bytes, r.h2d_bytes) == (512, 256)
    assert (r.d2h_s, r.h2d_s, r.recompute_s) == pytest.approx((0.25, 0.5, 0.125))
    monitor.close()


def test_bad_use_is_refused_with_a_clear_error():
    model = chain()
    with pytest.raises(ValueError, match="sample_every must be a positive integer"):
        StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=0)
    with pytest.raises(TypeError, match="stats\\(\\) method"):
        StageMonitor(layers_of(model), stage_index=0, device="cpu", saved_source=object())
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu")
    with pytest.raises(RuntimeError, match="without begin_iteration"):
        monitor.end_iteration()
    monitor.begin_iteration(0)
    with pytest.raises(RuntimeError, match="still open"):
        monitor.begin_iteration(1)
    monitor.close()
    with pytest.raises(ValueError, match="named by integer layer id"):
        layers_of(nn.Sequential(OrderedDict([("embed", nn.Linear(2, 2))])))


def test_a_failed_step_leaves_no_hooks_and_no_record():
    model = chain()
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=1)
    with pytest.raises(ZeroDivisionError):
        with monitor.iteration(0):
            train_step(model)
            raise ZeroDivisionError("a failing step")
    assert not any(m._forward_hooks for m in model.children())
    with monitor.iteration(1) as sample:
        train_step(model, micro_batches=1)
    assert sample.record.layers[0].fwd_calls == 1
    monitor.close()


def test_keep_all_source_counts_each_layer_and_skips_parameters():
    model = chain(width=16)
    source = KeepAllSource(layers_of(model))
    model(torch.randn(8, 16)).sum().backward()
    assert source.stats().activation_bytes == {5: 2 * 8 * 16 * 4, 6: 2 * 8 * 16 * 4, 7: 2 * 8 * 16 * 4}
    reading = source.stats()
    assert (reading.d2h_bytes, reading.h2d_bytes, reading.recompute_s) == (0, 0, 0.0)
    source.close()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_keep_all_source_can_count_only_the_first_call_after_enabling():
    model = chain(width=16)
    source = KeepAllSource(layers_of(model), enabled=False, first_call_only=True)
    model(torch.randn(8, 16))
    assert source.stats().activation_bytes == {}
    source.set_enabled(True)
    model(torch.randn(8, 16)).sum().backward()
    # counted, then unhooked
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    model(torch.randn(2, 16))  # not counted
    assert source.stats().activation_bytes[5] == 2 * 8 * 16 * 4
    source.set_enabled(True)
    model(torch.randn(2, 16))
    assert source.stats().activation_bytes[5] == 2 * 2 * 16 * 4
    source.close()


class SlowHead(nn.Linear):
    """A head that takes 5 ms a forward, far longer than the two small blocks: by waiting, not by work,
    which on two shared cores could come out faster than the blocks' (it did, 1 run in 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)
        return super().forward(x)


class WithHead(nn.Module):
    """A stage with modules outside its blocks: a slow head after them."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = chain(width, ids=(0, 1))
        self.head = SlowHead(width, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def test_the_modules_outside_the_blocks_are_timed_and_counted_apart_from_them():
    stage = WithHead()
    monitor = StageMonitor(layers_of(stage.blocks), stage_index=1, device="cpu", sample_every=1)
    monitor.watch_stage(stage)
    with monitor.iteration(0) as sample:
        train_step(stage, micro_batches=3)
    record = sample.record
    assert record.outside_calls == 3 and record.layer_ids == [0, 1]
    assert record.outside_param_bytes == (32 * 4096 + 4096) * 4  # the head's, not the blocks'
    blocks_fwd = sum(layer.fwd_s for layer in record.layers)
    assert record.outside_fwd_s > blocks_fwd  # the head is the heavy part
    assert record.outside_bwd_s > 0
    assert all(layer.bwd_s > 0 for layer in record.layers)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in stage.modules())  # gone after the sample


def test_a_stage_that_ends_with_a_block_has_nothing_outside_in_its_backward():
    model = chain()
    monitor = StageMonitor(layers_of(model), stage_index=0, device="cpu", sample_every=1)
    monitor.watch_stage(model)
    with monitor.iteration(0) as sample:
        train_step(model, micro_batches=2)
    record = sample.record
    assert record.outside_calls == 2 and record.outside_bwd_s == 0.0 and record.outside_param_bytes == 0
    assert record.layers[-1].bwd_s > 0  # the last block keeps its own backward time
