"""BatchNorm that updates its running statistics once per step, as one pass over the whole mini-batch would
(``vpipe.attach(..., deferred_batch_norm=True)``; the idea of torchgpipe's deferred batch norm).

Why: in a pipeline every micro-batch's forward folds its own statistics into ``running_mean`` and
``running_var`` with the momentum, so a step of m micro-batches makes m updates where the same model
trained unpipelined on the whole batch makes one, and the running statistics (what evaluation uses)
drift apart from that model's.

How: a deferred BatchNorm normalises each micro-batch in training with that micro-batch's own statistics
through the very ``F.batch_norm`` call plain BatchNorm makes, so outputs and gradients are plain
BatchNorm's bit for bit; only the running tensors it hands the kernel differ: fresh zeros with momentum
1, into which the kernel writes the micro-batch's mean and unbiased variance (what plain BatchNorm would
have folded in), with no extra pass over the activation. Those are merged, in float64, into a count, a
mean and a sum of squared deviations (the pairwise update of Chan, Golub and LeVeque, which loses no
precision to a large mean). At the end of the step :meth:`DeferredBatchNorm.commit` makes the one update:
the whole mini-batch's mean and unbiased variance with the momentum (``momentum=None``: the cumulative
average), and ``num_batches_tracked`` advances by one. Evaluation uses the running statistics as usual.

The accumulators are non-persistent buffers: not in ``state_dict`` (a checkpoint loads into plain
BatchNorm), yet a recomputed forward (the tensor manager's replay) puts them back as it puts back the
running statistics, a block moved to another stage carries them in its payload, and a block cloned for a
move has them. torch's first step (and the first after a move) runs each stage's forward once on
uninitialised tensors to learn shapes; :class:`DeferredNorms` keeps those forwards out of the statistics.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel

from vpipe.compat.torch_distributed import wrap_shape_inference
from vpipe.compat.torch_internals import BatchNormBase
from vpipe.stage.pipeline import LocalStage

__all__ = ["DeferredBatchNorm", "DeferredBatchNorm1d", "DeferredBatchNorm2d", "DeferredBatchNorm3d",
           "ACCUMULATORS", "defer_batch_norms", "commit_batch_norms", "restore_batch_norms", "DeferredNorms",
           "paused", "arriving", "accumulated", "handed_over"]

ACCUMULATORS = ("deferred_count", "deferred_mean", "deferred_m2")  # the buffers a deferred BatchNorm adds

# set while torch infers a stage's shapes: forwards on uninitialised tensors are not the step's micro-batches.
# A plain module global, not a ContextVar: torch.compile(fullgraph=True) reads it (guarding on it), not a
# ContextVar. Training runs on the rank's main thread, so the process's one flag is the step's.
_paused = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Forwards inside this block leave the accumulators alone (they still normalise as plain BatchNorm)."""
    global _paused
    before, _paused = _paused, True
    try:
        yield
    finally:
        _paused = before


class DeferredBatchNorm(BatchNormBase):
    """What the deferred BatchNorm1d/2d/3d share; made from torch's
    by :func:`defer_batch_norms`, never built."""

    deferred_count: torch.Tensor  # int64: values per channel seen since the last commit
    deferred_mean: torch.Tensor  # float64: their mean
    deferred_m2: torch.Tensor  # float64: their sum of squared deviations from it

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        assert self.running_mean is not None and self.running_var is not None
        mean, var = torch.zeros_like(self.running_mean), torch.zeros_like(self.running_var)
        out = F.batch_norm(input, mean, var, self.weight, self.bias, True, 1.0, self.eps)
        if not _paused:
            self._accumulate(mean, var, input.numel() // input.size(1))
        return out

    def _accumulate(self, mean: torch.Tensor, var: torch.Tensor, n: int) -> None:
        """Merge one micro-batch: ``n`` values per channel, their mean and unbiased variance."""
        self.merge(n, mean, var.to(self.deferred_m2.dtype) * (n - 1))

    @torch.no_grad()
    def merge(self, n: torch.Tensor | int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Merge a part (``n`` values per channel, their mean, their sum of squared deviations) into the
        accumulators, in place and without a host sync: the buffers stay the tensors a replay or a move's
        payload knows."""
        acc = self.deferred_mean
        count = self.deferred_count.to(acc.dtype)
        n_ = n.to(acc.dtype) if isinstance(n, torch.Tensor) else n
        share = n_ / (count + n_).clamp(min=1)  # (both empty: nothing moves)
        delta = mean.to(acc.dtype) - acc
        acc.add_(delta * share)
        self.deferred_m2.add_(m2.to(acc.dtype) + delta * delta * (count * share))
        self.deferred_count.add_(n)

    @torch.no_grad()
    def commit(self) -> None:
        """One update of the running statistics from what was accumulated since the last commit (nothing
        accumulated: nothing changes), then empty accumulators."""
        assert self.running_mean is not None and self.running_var is not None
        seen = self.deferred_count > 0
        count = self.deferred_count.to(self.deferred_mean.dtype)
        tracked = self.num_batches_tracked
        if tracked is not None:
            tracked.add_(seen.to(tracked.dtype))
        factor: torch.Tensor | float = 0.0  # as plain BatchNorm's: no momentum and no counter, no update
        if self.momentum is not None:
            factor = float(self.momentum)
        elif tracked is not None:  # the cumulative moving average: 1 / batches tracked
            factor = 1.0 / tracked.clamp(min=1).to(count.dtype)
        unbiased = self.deferred_m2 / (count - 1).clamp(min=1)
        for running, batch in ((self.running_mean, self.deferred_mean), (self.running_var, unbiased)):
            updated = running.to(batch.dtype) * (1 - factor) + batch * factor
            running.copy_(torch.where(seen, updated, running.to(batch.dtype)))
        for name in ACCUMULATORS:
            getattr(self, name).zero_()


class DeferredBatchNorm1d(DeferredBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d``, deferred."""


class DeferredBatchNorm2d(DeferredBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d``, deferred."""


class DeferredBatchNorm3d(DeferredBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d``, deferred."""


_DEFERRED: dict[type[nn.Module], type[DeferredBatchNorm]] = {
    nn.BatchNorm1d: DeferredBatchNorm1d, nn.BatchNorm2d: DeferredBatchNorm2d,
                                                             nn.BatchNorm3d: DeferredBatchNorm3d}
_PLAIN: dict[type[nn.Module], type[nn.Module]] = {deferred: plain for plain, deferred in _DEFERRED.items()}


def defer_batch_norms(module: nn.Module) -> int:
    """Make every BatchNorm1d/2d/3d in ``module`` that tracks running
    statistics deferred, in place; returns how many it changed.

    The same module objects stay (their class changes and three buffers are added), so parameters,
    optimizers, hooks and ``state_dict`` keys are untouched. One that does not track running statistics
    has nothing to defer and is left alone; a subclass of BatchNorm (``SyncBatchNorm``, a lazy one, the
    user's own) has a forward of its own and is refused, naming it.
    """
    changed = 0
    for name, m in module.named_modules():
        if isinstance(m, DeferredBatchNorm) or not isinstance(m, BatchNormBase) or not m.track_running_stats:
            continue
        deferred = _DEFERRED.get(type(m))
        if deferred is None:
            raise ValueError(f"deferred_batch_norm: {name or type(module).__name__} is a {type(m).__name__}, "
                             "whose forward vpipe cannot defer; it defers torch's BatchNorm1d, BatchNorm2d "
                             "and BatchNorm3d")
        assert m.running_mean is not None
        m.__class__ = deferred
        dtype = torch.float32 if m.running_mean.device.type == "mps" else torch.float64  # mps has no float64
        m.register_buffer(ACCUMULATORS[0], torch.zeros((), dtype=torch.int64, device=m.running_mean.device),
                          persistent=False)
        for acc in ACCUMULATORS[1:]:
            m.register_buffer(acc, torch.zeros_like(m.running_mean, dtype=dtype), persistent=False)
        changed += 1
    return changed


def _deferred(module: nn.Module) -> list[DeferredBatchNorm]:
    return [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]


def commit_batch_norms(module: nn.Module) -> None:
    """The end of a mini-batch: every deferred BatchNorm in ``module`` updates its running statistics once
    (one whose state is still on its way, :func:`arriving`, waits for it)."""
    for m in _deferred(module):
        if m not in _ARRIVING:
            m.commit()


# the deferred BatchNorms of blocks that joined a stage's forwards before their state arrived (a streamed
# PipeDream move, vpipe.migration.stream): the sender's running statistics and accumulators are still to come
_ARRIVING: weakref.WeakSet[DeferredBatchNorm] = weakref.WeakSet()


def arriving(block: nn.Module) -> None:
    """``block`` (an empty clone) runs forwards before its state arrives: its deferred BatchNorms
    accumulate from empty and are not committed until :func:`handed_over`."""
    for m in _deferred(block):
        for name in ACCUMULATORS:
            getattr(m, name).zero_()
        _ARRIVING.add(m)


def accumulated(block: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A copy of what ``block``'s deferred BatchNorms accumulated
    (count, mean, squared deviations), in order."""
    return [(m.deferred_count.clone(), m.deferred_mean.clone(), m.deferred_m2.clone())
            for m in _deferred(block)]


def handed_over(block: nn.Module, early: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """``block``'s state arrived, the sender's accumulators with it: those are of
    micro-batches before the switch, so of an earlier mini-batch than ``early`` (what it
    accumulated here before, :func:`accumulated`, taken before the state was loaded), and make
    their own update now; then ``early`` is merged in, for this step's."""
    for m, (n, mean, m2) in zip(_deferred(block), early):
        m.commit()
        m.merge(n, mean, m2)
        _ARRIVING.discard(m)


def restore_batch_norms(module: nn.Module) -> None:
    """Every deferred BatchNorm in ``module`` back to torch's class, what it accumulated committed first."""
    for m in _deferred(module):
        m.commit()
        for name in ACCUMULATORS:
            delattr(m, name)
        plain: nn.Module = m
        plain.__class__ = _PLAIN[type(m)]


class DeferredNorms:
    """One attach's deferred BatchNorms: every BatchNorm of the rank's stage modules (their blocks included)
    made deferred at attach, blocks a layer factory builds (a move's arrivals, added layers) made deferred as
    they are built, torch's shape inference kept out of the statistics, one commit at each step's end
    (:meth:`step_done`), and everything back to torch's BatchNorm at detach (:meth:`undo`).

    A block cloned for a move is deferred already: it is a copy of a deferred block of its
    kind. A carried ``AveragedModel`` of a stage (``carry=``) is made deferred alike,
    since its ``update_parameters`` pairs its buffers with the stage's one by one
    (``update_bn`` on it runs deferred forwards: call it after detach).
    """

    def __init__(self, stages: Sequence[LocalStage], carry: Sequence[Any] = ()) -> None:
        self.modules = [stage.module for stage in stages]
        self.modules += [a.module for a in carry if isinstance(a, AveragedModel)]
        self._undo: list[Callable[[], None]] = []
        try:
            for module in self.modules:
                defer_batch_norms(module)
            for stage in stages:
                if stage.pipeline_stage is not None:
                    undo = wrap_shape_inference(stage.pipeline_stage, paused)
                    if undo is not None:
                        self._undo.append(undo)
        except BaseException:
            # one refused part-way (a SyncBatchNorm): those made deferred before it are torch's again
            self.undo()
            raise

    def factory(self, build: Callable[[int, Any], nn.Module] | None) -> Callable[[int, Any],
                                                                                 nn.Module] | None:
        """``build`` (the user's layer factory), its blocks deferred; None for None."""
        if build is None:
            return None

        def deferred(layer_id: int, spec: Any) -> nn.Module:
            block = build(layer_id, spec)
            defer_batch_norms(block)
            return block

        return deferred

    def step_done(self) -> None:
        """The step's micro-batches have all run their forwards: one update of every running statistic."""
        for module in self.modules:
            commit_batch_norms(module)

    def undo(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()
        for module in self.modules:
            restore_batch_norms(module)
