"""PipeDream-2BW (double-buffered weights), on torch's ``PipelineStage``.

PipeDream-2BW (Narayanan et al., 2021; the WPipe paper's baseline) keeps PipeDream's 1F1B
order without flushes but updates the weights once per *update period* of ``m``
micro-batches (``m`` = micro-batches per ``step()``), accumulating the period's gradients.
Every micro-batch of period ``t`` runs forward and backward, on every stage, on weight
version ``t - 1`` (the weights after ``t - 1`` updates; periods 0 and 1 both run on the
initial weights), so the update has one delay term on all stages; for SGD::

    W(t+1) = W(t) - lr * grad f(W(t-1))

The period's gradient, accumulated on version ``t - 1``, is applied by the optimizer to the
live parameters (version ``t``). A new version can only be used by the next period: when
period ``t`` ends on a stage, up to ``p - k - 1`` micro-batches of period ``t + 1`` already
run there on version ``t``. So a stage holds at most two weight versions, ``t - 1`` and
``t`` (the live parameters then hold ``t`` or, after the update, ``t + 1`` while ``t - 1``
is gone): the stashed copies are the paper's two weight buffers (its Table 1), the live
parameters its model weights.

Decisions where the paper is silent (docs/schedules.md, "PipeDream-2BW"):

* the accumulated gradient is divided by ``m`` (``scale_grads=True``, torch's default for a
  loss that averages), so a period's update is the mini-batch's mean gradient;
* :meth:`flush` restarts the delay: the two periods after a flush run on the weights the
  flush left, as periods 0 and 1 run on the initial ones;
* the last stage stashes one version (its backward follows its forward at once, so no
  micro-batch of the next period is in flight when a period ends).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage

from vpipe.schedules.pipedream import SchedulePipeDream

__all__ = ["SchedulePipeDream2BW", "period_version"]


def period_version(mb: int, micro_batches: int, base_version: int = 0, base_period: int = 0) -> int:
    """Weight version micro-batch ``mb`` runs on under 2BW: that of two periods
    back, never one from before the stream's start (``base_version`` after
    ``base_period`` periods; 0 and 0 unless the stream was flushed)."""
    return base_version + max(0, mb // micro_batches - base_period - 1)


class SchedulePipeDream2BW(SchedulePipeDream):
    """1F1B without flushes, one optimizer step per period of
    ``n_microbatches`` micro-batches, two weight versions.

    Used like :class:`~vpipe.schedules.pipedream.SchedulePipeDream` (the schedule owns the
    optimizer steps)::

        sched = SchedulePipeDream2BW(stage, n_microbatches, loss_fn, optimizer)
        for x, y in data:
            sched.step(x, target=y)     # one update period; no optimizer.step() here
        sched.flush()                   # drain the micro-batches still in flight
    """

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        scale_grads: bool = True,
    ) -> None:
        # else a period's weights may not exist yet at its first forward
        if n_microbatches < stage.num_stages:
            raise ValueError("PipeDream-2BW needs an update period (micro-batches per step, "
                             f"{n_microbatches}) of at least the number of stages ({stage.num_stages})")
        super().__init__(stage, n_microbatches, loss_fn, optimizer)
        self.mean_grads = scale_grads  # divide the period's summed gradient by its micro-batches
        self._base_version = 0  # the version the first two periods after the (re)start run on
        self._base_period = 0

    # ---------------------------------------------------------------- public
    def flush(self, losses: list[torch.Tensor] | None = None) -> None:
        """Run the backward of every micro-batch in flight (each ends its period, so all updates are applied);
        the stream then restarts on the weights it left."""
        super().flush(losses)
        self._base_version = self.updates
        self._base_period = self._next_fwd // self._n_microbatches

    def move_versions(self, switch_mb: int, stage_index: int) -> range:
        """A streamed move at a period's start (``switch_mb``): the period's version and the one its old
        stage's update makes at the end of the period before, the same on every stage."""
        return range(self._version_for(switch_mb), self.updates_before(switch_mb) + 1)

    def updates_before(self, mb: int) -> int:
        """The updates applied once every period before the one of ``mb`` has ended (one a period)."""
        return self._base_version + mb // self._n_microbatches - self._base_period

    # ---------------------------------------------------------------- versions
    def _version_for(self, mb: int) -> int:
        return period_version(mb, self._n_microbatches, self._base_version, self._base_period)

    def _check_versions(self) -> None:
        """The schedule's invariant (``peak_versions`` 2, ``peak_stashed`` 2, 1 on the last stage: the paper's
        Table 1): a third version would mean a wrong release."""
        self._count_versions()
        if self.peak_versions > 2:
            raise RuntimeError(f"stage {self._stage.stage_index}: PipeDream-2BW held more than "
                               f"two weight versions (now {self.versions_held})")

    # ---------------------------------------------------------------- updates
    def _update_after(self, mb: int) -> None:
        """Gradients stay on the period's stashed weights, summed by autograd, until the period's last
        micro-batch; then they go to the live parameters and the optimizer steps once."""
        weights = self._versions[self._mb_version.pop(mb)]
        if (mb + 1) % self._n_microbatches:
            return
        for name, p in self._params().items():
            stashed = weights.get(name)
            grad = stashed.grad if stashed is not None else None
            if stashed is not None:
                stashed.grad = None
            if grad is not None and self.mean_grads:
                grad.div_(self._n_microbatches)
            p.grad = grad
        # free the period's version first (unless the next period runs on it too), then keep the live weights
        # the next period runs on before the step changes them in place: never a third copy
        self._release_versions()
        self._stash(self.updates)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        # every stash counted itself (peaks come at forwards); the live version moved on
        self._check_versions()
