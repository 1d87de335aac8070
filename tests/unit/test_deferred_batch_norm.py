"""Deferred BatchNorm (``deferred_batch_norm=True``): per micro-batch it is plain BatchNorm bit for bit, and
its running statistics take one update per step, those of one pass over the whole mini-batch.

Tolerance of the statistics: plain BatchNorm on the whole batch sums the batch in one order (float32 values,
a double accumulator on CPU); the deferred one gets each micro-batch's mean and variance from the same
kernel and merges them in float64. The two differ by the rounding of float32 sums, a few units in the last
place of float32 (relative 1e-7 to 1e-6 here), never by a missing or extra update, which would be off by
the momentum times the statistics' spread (1e-2 and more here): rtol=2e-6, atol=1e-6.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import vpipe
from support.migration import TWO, WIDTH, Block, Hub, Rank, run_ranks
from support.tensor_manager import make_manager
from vpipe.config import VpipeConfig
from vpipe.migration.averages import AveragedCopy
from vpipe.migration.carried import CarriedState
from vpipe.migration.cloning import clone_block
from vpipe.migration.state import pack_layer, unpack_layer
from vpipe.plan import Plan
from vpipe.stage.batch_norm import (
    ACCUMULATORS,
    DeferredBatchNorm,
    DeferredBatchNorm1d,
    DeferredBatchNorm2d,
    DeferredNorms,
    accumulated,
    arriving,
    commit_batch_norms,
    defer_batch_norms,
    handed_over,
    paused,
    restore_batch_norms,
)
from vpipe.stage.pipeline import LocalStage

TOL = {"rtol": 2e-6, "atol": 1e-6}
MICRO = 4


def _model(kind: str, affine: bool, momentum: float | None) -> tuple[nn.Module, tuple[int, ...]]:
    """A layer before one BatchNorm (its input does not depend on
    how the batch is split) and the input shape."""
    if kind == "1d":
        return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5, affine=affine, momentum=momentum)), (8, 6)
    if kind == "1d-seq":
        return nn.Sequential(nn.Conv1d(3, 5, 3), nn.BatchNorm1d(5, affine=affine, momentum=momentum)), (8, 3,
                                                                                                        9)
    if kind == "2d":
        return nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5, affine=affine, momentum=momentum)), (8, 3,
                                                                                                        7, 7)
    return nn.Sequential(nn.Conv3d(2, 4, 3), nn.BatchNorm3d(4, affine=affine, momentum=momentum)), (8, 2, 5,
                                                                                                    5, 5)


def _batch(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    # a mean and spread that change every step
    return torch.randn(shape, generator=gen) * (1 + step) + 3 * step


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("kind", ["1d", "1d-seq", "2d", "3d"])
def test_running_statistics_are_one_pass_over_the_whole_batch_and_outputs_plain_ones(kind, affine, momentum):
    torch.manual_seed(0)
    whole, shape = _model(kind, affine, momentum)
    per_micro = copy.deepcopy(whole)  # plain BatchNorm on the micro-batches: the outputs to match
    deferred = copy.deepcopy(whole)
    assert defer_batch_norms(deferred) == 1
    for step in range(5):
        x = _batch(step, shape)
        for mb in x.chunk(MICRO):
            mb = mb.clone().requires_grad_()
            plain_out, out = per_micro(mb), deferred(mb)
            assert torch.equal(out, plain_out)
            grads = torch.autograd.grad(out.square().sum(), [mb, *deferred.parameters()])
            plain_grads = torch.autograd.grad(plain_out.square().sum(), [mb, *per_micro.parameters()])
            for g, h in zip(grads, plain_grads):
                assert torch.equal(g, h)
        commit_batch_norms(deferred)  # the end of the step
        whole(x)
        bn, ref = deferred[1], whole[1]
        torch.testing.assert_close(bn.running_mean, ref.running_mean, **TOL)
        torch.testing.assert_close(bn.running_var, ref.running_var, **TOL)
        assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item() == step + 1
    # one update per micro-batch (plain BatchNorm in a pipeline) is far
    # from it: the tolerance tells them apart
    assert not torch.allclose(per_micro[1].running_var, whole[1].running_var, **TOL)
    deferred.eval()
    whole.eval()
    x = _batch(9, shape)
    assert torch.equal(deferred(x), nn.Sequential(deferred[0], _plain_like(deferred[1]))(x))


def _plain_like(bn: DeferredBatchNorm) -> nn.Module:
    """A plain BatchNorm with ``bn``'s parameters and running statistics."""
    plain = copy.deepcopy(bn)
    restore_batch_norms(plain)
    assert type(plain) is not type(bn) and isinstance(plain, nn.BatchNorm2d | nn.BatchNorm1d | nn.BatchNorm3d)
    return plain


def _collected_reference(model: nn.Module, xs: list[torch.Tensor]) -> None:
    """What one pass over the whole mini-batch gives each BatchNorm of
    ``model``: the micro-batches normalised on their own (as the pipeline does),
    then each BatchNorm run once, by torch, on everything it saw."""
    seen: dict[nn.Module, list[torch.Tensor]] = {}
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d | nn.BatchNorm1d)]
    handles = [bn.register_forward_pre_hook(lambda m, args: seen.setdefault(m, []).append(args[0].detach()))
               for bn in bns]
    for bn in bns:
        bn.track_running_stats = False  # normalise with the micro-batch's statistics, update nothing
    for x in xs:
        model(x)
    for handle in handles:
        handle.remove()
    for bn in bns:
        bn.track_running_stats = True
        bn(torch.cat(seen[bn]))


def test_several_batch_norms_in_a_row_match_each_one_pass_over_what_it_saw():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3),
                              nn.BatchNorm2d(4, momentum=None), nn.Flatten(), nn.Linear(36, 6),
                              nn.BatchNorm1d(6))
    deferred = copy.deepcopy(reference)
    assert defer_batch_norms(deferred) == 3
    for step in range(4):
        xs = list(_batch(step, (8, 3, 7, 7)).chunk(MICRO))
        for x in xs:
            deferred(x)
        commit_batch_norms(deferred)
        _collected_reference(reference, xs)
    for (name, b), c in zip(deferred.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(b, c, **TOL, msg=name)


def test_a_module_keeps_its_objects_keys_and_hooks_and_detach_gives_torch_s_batch_norm_back():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4, track_running_stats=False))
    bn, untracked, keys = model[1], model[2], list(model.state_dict())
    calls = []
    bn.register_forward_hook(lambda *_: calls.append(1))
    assert defer_batch_norms(model) == 1  # the one without running statistics has nothing to defer
    assert model[1] is bn and type(bn) is DeferredBatchNorm2d and type(untracked) is nn.BatchNorm2d
    assert list(model.state_dict()) == keys  # the accumulators are not part of a checkpoint
    assert {n for n, _ in bn.named_buffers()} == {"running_mean", "running_var", "num_batches_tracked",
                                                  *ACCUMULATORS}
    model(torch.randn(4, 3, 6, 6))
    assert calls == [1] and bn.deferred_count.item() == 4 * 16
    assert defer_batch_norms(model) == 0  # twice is once
    restore_batch_norms(model)  # what was accumulated is committed first
    assert type(bn) is nn.BatchNorm2d and {n for n, _ in bn.named_buffers()} == {
        "running_mean", "running_var", "num_batches_tracked"}
    assert bn.num_batches_tracked.item() == 1


def test_nothing_accumulated_commits_nothing_and_paused_forwards_are_not_counted():
    bn = nn.Sequential(nn.BatchNorm1d(3))
    plain = copy.deepcopy(bn)
    defer_batch_norms(bn)
    before = {n: b.clone() for n, b in bn.state_dict().items()}
    commit_batch_norms(bn)
    x = torch.randn(5, 3)
    with paused():  # torch's shape inference: uninitialised tensors, not a micro-batch
        assert torch.equal(bn(x), plain(x))
    assert bn[0].deferred_count.item() == 0
    commit_batch_norms(bn)
    for name, b in bn.state_dict().items():
        assert torch.equal(b, before[name]), name


def test_subclasses_with_their_own_forward_are_refused_by_name():
    model = nn.Sequential(nn.Linear(3, 3), nn.SyncBatchNorm(3))
    with pytest.raises(
        ValueError,
        match=r"deferred_batch_norm: 1 is a SyncBatchNorm, whose forward vpipe cannot "
        r"defer; it defers torch's BatchNorm1d, BatchNorm2d and BatchNorm3d",
    ):
        defer_batch_norms(model)


def _forwards_then_backwards(model: nn.Module, xs: list[torch.Tensor], manager: Any = None) -> None:
    """GPipe's order: every micro-batch's forward, then the backwards,
    last first (through ``manager`` if given)."""
    around = (lambda call, mb: getattr(manager,
                                       call)(mb)) if manager else (lambda call, mb: contextlib.nullcontext())
    outs = []
    for mb, x in enumerate(xs):
        with around("micro_batch", mb):
            outs.append(model(x))
    for mb in reversed(range(len(xs))):
        with around("backward", mb):
            outs[mb].sum().backward()


def test_a_recompute_leaves_the_accumulators_as_the_forwards_left_them():
    """The tensor manager's replay runs a recomputed forward again and puts buffers back: the accumulators
    are buffers, so the step still counts each micro-batch once."""
    torch.manual_seed(0)
    kept = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    defer_batch_norms(kept)
    recomputed = copy.deepcopy(kept)
    xs = [torch.randn(2, 1, 8, 8), torch.randn(3, 1, 8, 8)]
    _forwards_then_backwards(kept, xs)
    manager = make_manager(recomputed, {0: "R", 1: "R", 2: "R"})
    _forwards_then_backwards(recomputed, xs, manager)
    assert manager.stats().layers[1].recomputes == 2
    manager.close()
    assert recomputed[1].deferred_count.item() == (2 + 3) * 6 * 6
    for a, b in zip([*kept.buffers(), *(p.grad for p in kept.parameters())],
                    [*recomputed.buffers(), *(p.grad for p in recomputed.parameters())]):
        assert torch.equal(a, b)


def test_a_block_moved_mid_step_carries_its_accumulators_and_its_clone_stays_deferred():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    defer_batch_norms(block)
    block(torch.randn(6, 4))  # a micro-batch's forward before the move (a streamed PipeDream move)
    clone = clone_block(block)
    assert type(clone[1]) is type(block[1])
    unpack_layer(pack_layer(7, block, None), clone, None)
    for (name, b), c in zip(block.named_buffers(), clone.buffers()):
        assert torch.equal(b, c), name
    assert clone[1].deferred_count.item() == 6
    x = torch.randn(6, 4)
    assert torch.equal(block(x), clone(x))
    commit_batch_norms(block)
    commit_batch_norms(clone)
    for (name, b), c in zip(block.state_dict().items(), clone.state_dict().values()):
        assert torch.equal(b, c), name


def test_the_option_is_checked():
    assert VpipeConfig(deferred_batch_norm=True).deferred_batch_norm is True
    with pytest.raises(ValueError, match="deferred_batch_norm must be True or False, got 'yes'"):
        VpipeConfig(deferred_batch_norm="yes")  # type: ignore[arg-type]


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.bn(self.fc(h)))


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block(), _Block())


def _steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(8, 4) * (1 + s) + s, torch.randn(8, 4)) for s in range(3)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference_statistics() -> dict[str, torch.Tensor]:
    """The blocks without vpipe, without an optimizer step (the statistics are what is compared)."""
    model = _blocks()
    for x, _ in _steps():
        _collected_reference(model, list(x.chunk(MICRO)))
    return {k: v for k, v in model.state_dict().items() if ".bn.running" in k or "tracked" in k}


def _assert_statistics(model: nn.Module) -> None:
    state = model.state_dict()
    for name, want in _reference_statistics().items():
        torch.testing.assert_close(state[name], want, **TOL, msg=name)
    # detached
    assert all(type(m) is nn.BatchNorm1d for m in model.modules() if isinstance(m, nn.BatchNorm1d))


def test_under_a_schedule_each_step_updates_the_statistics_once_and_shape_inference_not_at_all(one_rank):
    model = _blocks()
    schedule = ScheduleGPipe(PipelineStage(model, 0, 1, torch.device("cpu")), MICRO, loss_fn=_loss)
    vp = vpipe.attach(schedule, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), planning=False,
                      deferred_batch_norm=True)
    try:
        assert all(isinstance(m, DeferredBatchNorm) for m in model.modules() if isinstance(m, nn.BatchNorm1d))
        for x, y in _steps():
            schedule.step(x, target=y)
    finally:
        vp.detach()
    _assert_statistics(model)


def test_a_hand_written_loop_updates_them_at_its_optimizer_step(one_rank):
    model = _blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    vp = vpipe.attach(model, optimizer=optimizer, planning=False, micro_batches=MICRO,
                      deferred_batch_norm=True)
    try:
        for step, (x, y) in enumerate(_steps()):
            for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
                _loss(model(xm), ym).backward()
            # this step's comes at its end
            assert model[0].bn.num_batches_tracked.item() == vp.iteration == step
            optimizer.step()
    finally:
        vp.detach()
    _assert_statistics(model)


class _NormBlock(Block):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.fc(x)))


@pytest.mark.parametrize("use_buffers", [True, False])
@pytest.mark.parametrize("average_made", ["before attach", "after attach"])
def test_a_moved_deferred_block_arrives_deferred_and_its_average_keeps_the_average_s_form(average_made,
                                                                                          use_buffers):
    """A carried ``AveragedModel`` of the stage made after attach holds deferred BatchNorms;
    one made before holds torch's, made deferred by the attach (``update_parameters`` pairs
    its buffers with the stage's one by one, whether it averages them or copies them). The
    moved block's average joins the receiver's deferred."""
    hub = Hub(2)
    ranks = [Rank(0, TWO, [0, 1], hub, kind=_NormBlock), Rank(1, TWO, [0, 1], hub, kind=_NormBlock)]
    averages, norms = {}, []
    for rank in ranks:
        v, container = next(iter(rank.containers.items()))
        if average_made == "after attach":
            defer_batch_norms(container)
        averages[rank] = AveragedModel(container, multi_avg_fn=get_ema_multi_avg_fn(0.9),
                                       use_buffers=use_buffers)
        norms.append(DeferredNorms([LocalStage(v, container)], carry=[averages[rank]]))
        rank.manager.carry = CarriedState({v: [AveragedCopy(averages[rank], rank.manager.blocks[v])]})
    source_block = ranks[0].block(2)
    source_block(torch.randn(4, WIDTH))  # accumulated, not committed: what a mid-step move would carry
    sent = {n: b.clone() for n, b in source_block.named_buffers()}

    run_ranks(ranks, Plan(epoch=1, stages=((0, 1), (2, 3, 4, 5))))

    arrived = ranks[1].block(2)
    assert type(arrived.bn) is DeferredBatchNorm1d and arrived.bn.deferred_count.item() == 4
    for name, b in arrived.named_buffers():
        assert torch.equal(b, sent[name]), name
    received = averages[ranks[1]]
    assert [type(m) for m in received.module.modules()
            if isinstance(m, nn.BatchNorm1d)] == [DeferredBatchNorm1d] * 4
    received.update_parameters(ranks[1].containers[1])  # zipped with the stage module without a mismatch
    norms[1].undo()  # detach: torch's BatchNorm again, in the stage and (when made deferred) in the average
    if average_made == "before attach":
        assert all(type(m) is nn.BatchNorm1d for m in [*received.modules(), *ranks[1].containers[1].modules()]
                   if isinstance(m, nn.BatchNorm1d))


def test_a_block_compiled_with_fullgraph_defers_too():
    """torch.compile(fullgraph=True) traces the deferred forward
    whole (the pause flag is a global it guards on)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    deferred = copy.deepcopy(plain)
    defer_batch_norms(deferred)
    compiled = torch.compile(deferred, fullgraph=True, backend="eager")
    xs = [torch.randn(6, 4) + i for i in range(3)]
    with paused():
        compiled(torch.randn(6, 4))
    for x in xs:
        assert torch.equal(compiled(x), plain(x))
    commit_batch_norms(deferred)
    whole = nn.BatchNorm1d(4)  # a fresh one: the statistics deferred[1] started from
    with torch.no_grad():
        whole(deferred[0](torch.cat(xs)))
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(deferred[1].state_dict()[name], value, **TOL, msg=name)


def test_a_block_streamed_mid_step_updates_once_for_the_sender_s_mini_batch_and_once_for_this_one():
    """A streamed PipeDream move: micro-batches before the switch ran on the
    sender (an earlier mini-batch), those from it run on the receiver's
    clone before the sender's state arrives at the hand-over."""
    torch.manual_seed(0)
    source = nn.Sequential(nn.BatchNorm1d(4, momentum=None))
    defer_batch_norms(source)
    xs = [torch.randn(6, 4) * (1 + i) + i for i in range(4)]
    for x in xs[:2]:  # the sender's last micro-batches (its mini-batch's end)
        source(x)
    target = clone_block(source)
    arriving(target)  # joins the receiver's forwards at the switch, its tensors still empty
    for x in xs[2:]:
        target(x)
    commit_batch_norms(target)  # a step's end before the hand-over: the update waits for the sender's part
    assert target[0].deferred_count.item() == 12
    early = accumulated(target)
    unpack_layer(pack_layer(3, source, None), target, None)
    handed_over(target, early)
    commit_batch_norms(target)
    reference = nn.BatchNorm1d(4, momentum=None)
    with torch.no_grad():
        reference(torch.cat(xs[:2]))
        reference(torch.cat(xs[2:]))
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(target[0].state_dict()[name], value, **TOL, msg=name)
    assert target[0].num_batches_tracked.item() == 2
