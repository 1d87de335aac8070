"""WPipe (double-grouped weight updates, "2GW"), on torch's ``PipelineStage``.

WPipe (Yang et al., ICLR 2022) splits the model into ``2W`` partitions on ``W`` ranks and
puts them in two groups that share the ranks: G0 is the first half of the model (stage
``r`` on rank ``r``), G1 the second half (stage ``W + r`` on rank ``r``), so a micro-batch
goes down the ranks through G0, down them again through G1, and back up twice. G1 keeps
its order: its forwards and backwards of period ``t`` run in a 1F1B order with nothing of
another period between them, and it updates after the period's last backward, so it runs
on the newest weights with one version and no delay. G0's forward of period ``t + 1`` is
moved in front of its backward of period ``t`` (the two form the paper's V: forward down,
backward up), so G0 runs period ``t`` on the weights before period ``t - 1``'s update: two
versions and one delay term, as PipeDream-2BW. The groups update alternately: G0 at the end
of its backwards, G1 at the end of its period. For SGD::

    W0(t+1) = W0(t) - lr * grad_0 f(W0(t-1), W1(t))
    W1(t+1) = W1(t) - lr * grad_1 f(W0(t-1), W1(t))

A step feeds period ``t``; each rank runs G0's 1F1B list (period ``t``'s forwards, period
``t - 1``'s backwards) and G1's (period ``t``) merged as the paper's Figure 5 interleaves
them (:func:`rank_orders`); G0 updates after its last backward, G1 at the step's end.
Decisions where the paper is silent are in docs/schedules.md ("WPipe"): the gradient is the
period's mean (``scale_grads=True``), period 0 runs G0 on the initial weights
(``W0(-1) = W0(0)``), :meth:`flush` ends every period so the period after it runs G0
without the delay, one optimizer holds both groups (a group's update steps it with only
that group's gradients set, the other's set aside).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import PipelineScheduleMulti
from torch.func import functional_call

from vpipe.schedules.wpipe_order import one_f_one_b, rank_orders, steady_order

__all__ = ["ScheduleWPipe", "one_f_one_b", "rank_orders", "steady_order"]


def _tagged(ops: list[dist.P2POp], boundary: int, backward: bool) -> list[dist.P2POp]:
    """Each boundary's activations and its gradients travel under a tag of their
    own: a rank's two stages talk to the same neighbours, and a G1 gradient sent in
    one step is received in the next, after other messages."""
    for op in ops:
        op.tag = 2 * boundary + int(backward) + 1
    return ops


class ScheduleWPipe(PipelineScheduleMulti):
    """Two stages per rank (G0's and G1's), one update of each group per period of ``n_microbatches``.

    Each rank builds its two stages ``PipelineStage(g0_module, r, 2 * W, dev)`` and
    ``PipelineStage(g1_module, W + r, 2 * W, dev)`` and one optimizer over both::

        sched = ScheduleWPipe([g0_stage, g1_stage], n_microbatches, loss_fn, optimizer)
        for x, y in data:
            sched.step(x, target=y)     # one period; no optimizer.step() here
        sched.flush()                   # run G0's backwards still in flight, apply their update
    """

    def __init__(
        self,
        stages: list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        scale_grads: bool = True,
    ) -> None:
        if len(stages) != 2:
            raise ValueError(f"WPipe runs two stages per rank (G0's and G1's), got {len(stages)}")
        g0, g1 = stages
        ranks = g0.group_size
        if g0.num_stages != 2 * ranks or g1.num_stages != 2 * ranks:
            raise ValueError(f"WPipe needs 2 x ranks stages ({2 * ranks}), the stages say {g0.num_stages}")
        rank = g0.group_rank
        if (g0.stage_index, g1.stage_index) != (rank, ranks + rank):
            raise ValueError(f"WPipe: rank {rank} runs stages {rank} (G0) and {ranks + rank} (G1), got "
                             f"{g0.stage_index} and {g1.stage_index}")
        if n_microbatches < ranks:
            raise ValueError("WPipe needs an update period (micro-batches per step, "
                             f"{n_microbatches}) of at least the number of ranks ({ranks})")
        # two periods are in flight on G0's stage: torch's stages get a
        # chunk slot for each of 2m micro-batches
        super().__init__(list(stages), 2 * n_microbatches, loss_fn, scale_grads=False)
        self.micro_batches = n_microbatches
        self._groups = (g0, g1)  # the rank's stages, G0's and G1's (torch keeps them in ``_stages`` too)
        self.pipeline_order = cast(Any, steady_order(ranks, n_microbatches))
        # streamed moves of G0's blocks (vpipe.migration.stream), and the parameters of blocks that left G0's
        # forward but still take the update of the period in flight (docs/schedules.md, "WPipe")
        self.movers: list[Any] = []
        self.departing: dict[str, torch.nn.Parameter] = {}
        self._base = (0, 0)  # G0's version and the period the stream (re)started at: 0, 0 until a flush
        self.optimizer = optimizer
        self.mean_grads = scale_grads
        self.ranks = ranks
        self.updates = [0, 0]  # updates applied to G0 and G1 = their newest weight versions
        self._versions: dict[int, dict[str, torch.Tensor]] = {}  # G0's stashed versions
        self._period_version: dict[int, int] = {}  # G0's version of each period in flight
        self._period = 0  # the next period to feed
        self._g0_pending: int | None = None  # the period whose G0 backwards are still to run
        self.peak_versions = [1, 1]  # distinct versions held at once (stashed and live), per group
        self.peak_stashed = [0, 0]  # copies beside the live weights, per group (G1 makes none)
        self._losses: dict[int, torch.Tensor] = {}
        self._send_work: list[tuple[int, Any, Any]] = []  # (step, work, tensor kept alive until done)
        self._steps = 0
        # (seconds, "F" | "B", stage, period, micro-batch) of the latest actions
        self.trace: deque[tuple[float, str, int, int, int]] = deque(maxlen=20_000)

    # ---------------------------------------------------------------- public
    @property
    def versions_held(self) -> list[list[int]]:
        """The weight versions each group holds now (G0's stashed ones and its live ones; G1's live ones)."""
        return [sorted(set(self._versions) | {self.updates[0]}), [self.updates[1]]]

    @property
    def in_flight(self) -> list[int]:
        """The periods whose G0 backwards have not run yet (one between steps, none after a flush)."""
        return [] if self._g0_pending is None else [self._g0_pending]

    def in_flight_chunks_of(self, stage_index: int) -> list[int]:
        """The chunk ids stage ``stage_index``'s methods were given for its
        micro-batches in flight between steps: G0's period whose backwards run in the
        next step, none on G1's stage (its period ends in its step)."""
        pending = self._g0_pending
        if stage_index != self._groups[0].stage_index or pending is None:
            return []
        return [self._slot(pending, j) for j in range(self.micro_batches)]

    def period_version(self, period: int) -> int | None:
        """The G0 weight version a period in flight runs on."""
        return self._period_version.get(period)

    # ---------------------------------------------------------------- streamed moves of G0's blocks
    @property
    def next_forward(self) -> int:
        """G0's next micro-batch to run forward, counted over the stream (period t's j-th is ``t m + j``)."""
        return self._period * self.micro_batches

    @property
    def stream_updates(self) -> int:
        """The updates G0 applied: its newest weight version (G0's blocks are the ones that stream)."""
        return self.updates[0]

    def streams_stage(self, stage_index: int) -> bool:
        """Whether a block of stage ``stage_index`` moves inside the stream (G0's), or at a step boundary
        (G1's: its period ends within the step)."""
        return stage_index < self.ranks

    def _version_of_period(self, period: int) -> int:
        version, start = self._base
        return version + max(0, period - start - 1)

    def move_versions(self, switch_mb: int, stage_index: int) -> range:
        """A G0 move switching at period ``switch_mb // m``'s start: the version that period runs on and the
        one its old stage's update with the period before's gradient makes, the same on every G0 stage."""
        first = self._version_of_period(switch_mb // self.micro_batches)
        return range(first, self.updates_before(switch_mb) + 1)

    def updates_before(self, mb: int) -> int:
        """G0's updates applied once every period before micro-batch ``mb``'s has ended (one a period)."""
        version, start = self._base
        return version + mb // self.micro_batches - start

    @property
    def upcoming_version(self) -> int:
        """The G0 weight version the next period runs on."""
        return self._version_of_period(self._period)

    def stashed(self, version: int) -> dict[str, torch.Tensor] | None:
        """G0's stashed weights of ``version`` (name -> tensor), None when not kept (now)."""
        return self._versions.get(version)

    def stashed_versions(self) -> list[dict[str, torch.Tensor]]:
        """Every stashed copy of G0's weights held now (name -> tensor), oldest first."""
        return [self._versions[v] for v in sorted(self._versions)]

    def defer_wait(self, work: Any, keep_alive: Any = None) -> None:
        """Wait for ``work`` (a send) at the end of the next step, keeping ``keep_alive`` until then."""
        self._send_work.append((self._steps, work, keep_alive))

    def step(self, *args: Any, target: Any = None, losses: list[torch.Tensor] | None = None,
             **kwargs: Any) -> None:
        """Feed one period (``n_microbatches`` micro-batches): G0's and G1's actions of the step
        interleaved (see :func:`rank_orders`); the last stage's losses are the period's."""
        if not torch.is_grad_enabled():
            raise RuntimeError("ScheduleWPipe.step() trains; it cannot run under torch.no_grad()")
        m = self.micro_batches
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, kwargs, m)
        target_mbs = None if target is None else [c[0]
                                                  for c in split_args_kwargs_into_chunks((target,), None,
                                                                                         m)[0]]
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses)

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        m = self.micro_batches
        arg_mbs = arg_mbs or [()] * m
        kwarg_mbs = kwarg_mbs or [{}] * m
        if not self._stages_forward_initialized:
            self._has_backward = True
            for stage in self._groups:
                stage.has_backward = True
            self._initialize_stages(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs else None)
        t = self._period
        step_losses = self._run(t, arg_mbs, kwarg_mbs, target_mbs)
        self._period += 1
        for mover in self.movers:  # after a flush a step may apply no G0 update: a hand-over due comes here
            mover.after_update(self.updates[0])
        self.movers = [mover for mover in self.movers if not mover.done]
        self._wait_sends(before_step=self._steps)
        self._steps += 1
        if losses is not None:
            losses.clear()
            losses.extend(step_losses)

    def flush(self) -> None:
        """Run G0's backwards still in flight and apply their update; the stream then restarts on the weights
        it left (the period after a flush runs G0 without the delay)."""
        if self._g0_pending is not None:
            self._run(None, [], [], None)
        self._wait_sends()
        self._base = (self.updates[0], self._period)

    # ---------------------------------------------------------------- a step
    def _run(self, t: int | None, arg_mbs: list[Any], kwarg_mbs: list[Any],
             target_mbs: list[Any] | None) -> list[torch.Tensor]:
        """This rank's actions of a step (:func:`rank_orders`): G0's forwards of period ``t`` (None: a flush,
        none) and backwards of the period before, G1's period ``t``; G0's update after its last backward, G1's
        at the end."""
        g0, g1 = self._groups
        pending = self._g0_pending
        ops = rank_orders(self.ranks, self.micro_batches, t is not None, pending is not None)[self.rank]
        g0_left = sum(1 for g, _, _ in ops if g == 0)
        losses = []
        for group, kind, j in ops:
            if group == 0:
                if kind == "F":
                    self._forward_g0(cast(int, t), j, arg_mbs[j], kwarg_mbs[j])
                else:
                    self._backward(g0, cast(int, pending), j)
                    for mover in self.movers:  # a block that arrived takes its live state before its update
                        mover.before_update(cast(int, pending) * self.micro_batches + j)
                g0_left -= 1
                if not g0_left and pending is not None:
                    self._update_g0(pending)
            elif kind == "F":
                self._forward_g1(cast(int, t), j, target_mbs)
            else:
                loss = self._backward(g1, cast(int, t), j)
                if loss is not None:
                    losses.append(loss)
        if t is not None:
            self._apply(1, {name: p.grad for name, p in g1.submod.named_parameters()})
        self._g0_pending = t
        return losses

    # ---------------------------------------------------------------- actions
    def _slot(self, period: int, j: int) -> int:
        return (period % 2) * self.micro_batches + j

    def _forward_g0(self, t: int, j: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stage, slot = self._groups[0], self._slot(t, j)
        self._recv(stage, stage.get_fwd_recv_ops(slot))
        for mover in self.movers:  # a streamed move switches here at its period's first micro-batch
            mover.before_forward(t * self.micro_batches + j)
        if j == 0:  # the period runs on the live version: copied aside, since an update changes it in place
            self._period_version[t] = self._stash(self.updates[0])
        version = self._period_version[t]
        weights = self._versions[version]
        for mover in self.movers:  # the version of a block that arrived comes from its old stage
            mover.add_weights(version, weights)
        module = stage.submod
        held = {name for name, _ in module.named_parameters()}
        if len(held) != len(weights):  # a version stashed before a move names blocks that left
            weights = {name: w for name, w in weights.items() if name in held}

        def run_on_version(*a: Any, **kw: Any) -> Any:
            return functional_call(module, weights, a, kw)

        # an instance attribute over torch's method, removed below (cast: mypy forbids assigning to a method)
        cast(Any, stage).forward_maybe_with_nosync = run_on_version
        try:
            stage.forward_one_chunk(slot, args, kwargs, save_forward_output=False)
        finally:
            del stage.forward_maybe_with_nosync
        self._send(stage, stage.get_fwd_send_ops(slot))
        self._log("F", stage, t, j)

    def _forward_g1(self, t: int, j: int, target_mbs: list[Any] | None) -> None:
        """On G1's live weights: G1 updates only once its period is over."""
        stage, slot = self._groups[1], self._slot(t, j)
        self._recv(stage, stage.get_fwd_recv_ops(slot))
        output = stage.forward_one_chunk(slot, (), {}, save_forward_output=False)
        if stage.is_last:
            self._losses[slot] = self._compute_loss(output, target_mbs[j] if target_mbs else None)
        self._send(stage, stage.get_fwd_send_ops(slot))
        self._log("F", stage, t, j)

    def _backward(self, stage: PipelineStage, period: int, j: int) -> torch.Tensor | None:
        slot = self._slot(period, j)
        self._recv(stage, stage.get_bwd_recv_ops(slot), backward=True)
        loss = self._losses.pop(slot, None)
        stage.backward_one_chunk(slot, loss=loss, last_backward=False)
        self._send(stage, stage.get_bwd_send_ops(slot), backward=True)
        self._log("B", stage, period, j)
        return loss.detach() if loss is not None else None

    def _log(self, kind: str, stage: PipelineStage, period: int, j: int) -> None:
        self.trace.append((time.perf_counter(), kind, stage.stage_index, period, j))

    # ---------------------------------------------------------------- versions and updates
    def _stash(self, version: int) -> int:
        if version not in self._versions:
            self._versions[version] = {name: p.detach().clone().requires_grad_(p.requires_grad)
                                       for name, p in self._groups[0].submod.named_parameters()}
        self._count()
        return version

    def _count(self) -> None:
        held = self.versions_held
        self.peak_versions = [max(self.peak_versions[g], len(held[g])) for g in range(2)]
        self.peak_stashed[0] = max(self.peak_stashed[0], len(self._versions))
        if self.peak_versions[0] > 2 or self.peak_versions[1] > 1:  # the paper's Table 1: a wrong release
            raise RuntimeError(
                f"rank {self.rank}: WPipe held weight versions {held} (G0 at most two, G1 one)"
            )

    def _update_g0(self, period: int) -> None:
        """G0's update with ``period``'s gradient, summed on the version it ran on: that version is dropped
        first (the next period's is kept), so the live weights make the second version, never a third."""
        version = self._period_version.pop(period)
        weights = self._versions.pop(version) if version not in self._period_version.values() else \
            self._versions[version]
        grads = {name: w.grad for name, w in weights.items()}
        for w in weights.values():
            w.grad = None
        self._apply(0, grads)
        for mover in self.movers:  # the versions a move sends and its hand-over come after an update
            mover.after_update(self.updates[0])

    def _apply(self, group: int, grads: dict[str, torch.Tensor | None]) -> None:
        """Step the optimizer on ``group``'s gradients alone: the other group's (G1's, summing on its live
        parameters while G0 updates mid-step) are set aside and put back."""
        other = [(p, p.grad) for p in self._groups[1 - group].submod.parameters() if p.grad is not None]
        for p, _ in other:
            p.grad = None
        params = dict(self._groups[group].submod.named_parameters())
        if group == 0:
            params.update(self.departing)  # blocks that left G0's forward take the update of their period
        for name, p in params.items():
            grad = grads.get(name)
            if grad is not None and self.mean_grads:
                grad = grad.div_(self.micro_batches)
            p.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p, grad in other:
            p.grad = grad
        self.updates[group] += 1
        self._count()

    # ---------------------------------------------------------------- p2p
    def _recv(self, stage: PipelineStage, ops: list[dist.P2POp], backward: bool = False) -> None:
        if ops:
            boundary = stage.stage_index if backward else stage.stage_index - 1
            for work in dist.batch_isend_irecv(_tagged(ops, boundary, backward)):
                work.wait()

    def _send(self, stage: PipelineStage, ops: list[dist.P2POp], backward: bool = False) -> None:
        if ops:
            boundary = stage.stage_index - 1 if backward else stage.stage_index
            for work in dist.batch_isend_irecv(_tagged(ops, boundary, backward)):
                self.defer_wait(work)

    def _wait_sends(self, before_step: int | None = None) -> None:
        keep = []
        for step, work, alive in self._send_work:
            if before_step is None or step < before_step:
                work.wait()
            else:
                keep.append((step, work, alive))
        self._send_work = keep
