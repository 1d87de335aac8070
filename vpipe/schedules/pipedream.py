"""PipeDream asynchronous 1F1B with weight stashing, on torch's ``PipelineStage``.

torch ships flush schedules only (GPipe, 1F1B, interleaved, zero-bubble). PipeDream never
flushes: every stage applies an optimizer step after each micro-batch's backward, and a
micro-batch's backward must use the very weights its forward used, although newer
weights exist by then. That is weight stashing: each in-flight micro-batch keeps the
weight version it started with as separate tensors and the stage's module runs on them
through :func:`torch.func.functional_call` (rewriting ``.data`` or ``load_state_dict``
would corrupt autograd's saved-tensor version counters).

Micro-batches stream across ``step()`` calls: step ``s`` feeds micro-batches
``[s*m, (s+1)*m)`` and runs this stage's 1F1B action sequence up to the first forward of
the next step, so there is no drain between steps; :meth:`flush` drains at the end.

Version numbering: version ``v`` of a stage is its weights after ``v`` optimizer steps.
Stage ``k`` of ``p`` runs ``p-k`` forwards before its first backward, so micro-batch ``i``
starts on version ``max(0, i-(p-k)+1)``; with vertical sync every stage uses the version
stage 0 used, ``max(0, i-p+1)``. Each micro-batch's gradient is that of its own loss
(no division by the number of micro-batches).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.func import functional_call

from vpipe.compat.torch_distributed import initialize_stage
from vpipe.compat.torch_internals import child_modules

__all__ = ["SchedulePipeDream", "StreamMover", "start_version"]


class StreamMover(Protocol):
    """A layer migration carried out inside the stream (see :mod:`vpipe.migration.stream`).

    The schedule calls these at fixed points of its action sequence, so both stages of a
    move switch at the same micro-batch without a flush.
    """

    def before_forward(self, mb: int) -> None: ...

    def add_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None: ...

    def before_update(self, mb: int) -> None: ...

    def after_update(self, updates: int) -> None: ...

    @property
    def done(self) -> bool: ...


def start_version(mb: int, stage_index: int, num_stages: int, vertical_sync: bool) -> int:
    """Weight version micro-batch ``mb`` uses on a stage (see the module docstring)."""
    in_flight = num_stages if vertical_sync else num_stages - stage_index
    return max(0, mb - in_flight + 1)


class SchedulePipeDream(PipelineScheduleSingle):
    """Asynchronous 1F1B with weight stashing and an optimizer step per micro-batch.

    Use like torch's schedules, except that the schedule owns the optimizer steps::

        sched = SchedulePipeDream(stage, n_microbatches, loss_fn, optimizer)
        for x, y in data:
            sched.step(x, target=y)     # no optimizer.step() here: one per micro-batch
        sched.flush()                   # drain the micro-batches still in flight
    """

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        vertical_sync: bool = False,
    ) -> None:
        super().__init__(stage, n_microbatches, loss_fn, scale_grads=False)
        if n_microbatches < stage.num_stages:
            raise ValueError(
                f"PipeDream needs at least as many micro-batches per step ({n_microbatches}) "
                f"as stages ({stage.num_stages})"
            )
        self.optimizer = optimizer
        self.vertical_sync = vertical_sync
        self.updates = 0  # optimizer steps applied on this stage = newest weight version
        self._stream_start = 0  # micro-batch where the current (unflushed) stream began
        self._next_fwd = 0
        self._next_bwd = 0
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        # the most stashed versions (copies beside the live weights) and distinct versions (stashed and live)
        # held at once: what the papers count (PipeDream p - k; 2BW two)
        self.peak_stashed = 0
        self.peak_versions = 1
        self._mb_version: dict[int, int] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._targets: dict[int, Any] = {}
        # sends finish when the peer receives, which may be in the peer's *next* step (a stage's
        # backward sends are received by the stage before it one step later): so a step only
        # waits for the sends of earlier steps, never its own (that would deadlock)
        self._send_work: list[tuple[int, Any, Any]] = []  # (step, work, tensor kept alive until done)
        self._steps = 0
        # live migration (vpipe.migration.stream): moves in progress, and the parameters of
        # layers that left the forward but still receive their in-flight micro-batches' updates
        self.movers: list[StreamMover] = []
        self.departing: dict[str, torch.nn.Parameter] = {}
        self._held_cache: tuple[tuple[str, ...], set[str]] | None = None
        # (seconds, "F" | "B", micro-batch, in flight after it) of the latest actions: shows there is no drain
        self.trace: deque[tuple[float, str, int, int]] = deque(maxlen=20_000)

    # ---------------------------------------------------------------- public
    @property
    def in_flight(self) -> list[int]:
        """Micro-batches whose forward ran here and whose backward did not yet."""
        return list(range(self._next_bwd, self._next_fwd))

    @property
    def in_flight_chunks(self) -> list[int]:
        """The chunk ids the stage's methods were given for the micro-batches in flight (a slot per
        micro-batch of a step, reused from step to step)."""
        return [self._slot(mb) for mb in range(self._next_bwd, self._next_fwd)]

    def in_flight_chunks_of(self, stage_index: int) -> list[int]:
        """:attr:`in_flight_chunks` of the stage ``stage_index`` (this schedule's one stage)."""
        return self.in_flight_chunks

    @property
    def next_forward(self) -> int:
        """The micro-batch whose forward runs next here (counted over the whole stream, across steps)."""
        return self._next_fwd

    @property
    def versions_held(self) -> list[int]:
        """The weight versions this stage holds now: its stashed
        ones and the live parameters' (``updates``)."""
        return sorted(set(self._versions) | {self.updates})

    def stashed_versions(self) -> list[dict[str, torch.Tensor]]:
        """Every stashed copy of the weights this stage holds now (name -> tensor), oldest first."""
        return [self._versions[v] for v in sorted(self._versions)]

    def stashed(self, version: int) -> dict[str, torch.Tensor] | None:
        """The stashed weights of ``version`` (name -> tensor), None
        when this stage does not keep them (now)."""
        return self._versions.get(version)

    def move_versions(self, switch_mb: int, stage_index: int) -> range:
        """The weight versions of a layer that runs on stage ``stage_index`` from micro-batch ``switch_mb`` (a
        streamed move, :mod:`vpipe.migration.stream`) that its old stage makes: from the version ``switch_mb``
        runs on there to the one made by the update after micro-batch ``switch_mb - 1``."""
        first = start_version(switch_mb, stage_index, self._stage.num_stages, self.vertical_sync)
        return range(first, self.updates_before(switch_mb) + 1)

    def updates_before(self, mb: int) -> int:
        """The updates applied once every micro-batch before ``mb``
        ran its backward: one each under PipeDream."""
        return mb

    @property
    def stream_updates(self) -> int:
        """The updates this stage applied (what a streamed move counts versions by)."""
        return self.updates

    def streams_stage(self, stage_index: int) -> bool:
        """Whether a block of stage ``stage_index`` moves inside the stream: every stage's does."""
        return True

    @property
    def upcoming_version(self) -> int:
        """The weight version the next forward here runs on."""
        return self._version_for(self._next_fwd)

    def version_of(self, mb: int) -> dict[str, torch.Tensor]:
        """The stashed weights an in-flight micro-batch uses (name -> tensor)."""
        return self._versions[self._mb_version[mb]]

    def step(self, *args: Any, target: Any = None, losses: list[torch.Tensor] | None = None,
             **kwargs: Any) -> None:
        """Feed one batch of ``n_microbatches`` micro-batches; returns once they are all forwarded here."""
        if not torch.is_grad_enabled():
            raise RuntimeError("SchedulePipeDream.step() trains; it cannot run under torch.no_grad()")
        self._stage.has_backward = True
        arg_mbs, kwarg_mbs = self._split_inputs(args, kwargs)
        self._step_microbatches(arg_mbs, kwarg_mbs, self._split_target(target), losses)

    def _step_microbatches(
        self,
        arg_mbs: list[tuple[Any, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        if not self._stage_forward_initialized:
            initialize_stage(self, arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs else None)
        first, m = self._next_fwd, self._n_microbatches
        for j in range(m):
            self._targets[first + j] = target_mbs[j] if target_mbs else None
        step_losses: list[torch.Tensor] = []
        while True:
            action, mb = self._next_action()
            if action == "F" and mb >= first + m:
                break
            if action == "F":
                self._forward(mb, arg_mbs[mb - first], kwarg_mbs[mb - first])
            else:
                loss = self._backward(mb)
                if loss is not None:
                    step_losses.append(loss)
            self.trace.append((time.perf_counter(), action, mb, self._next_fwd - self._next_bwd))
        self._wait_sends(before_step=self._steps)
        self._steps += 1
        if losses is not None:
            losses.clear()
            losses.extend(step_losses)

    def flush(self, losses: list[torch.Tensor] | None = None) -> None:
        """Run the backward of every micro-batch still in flight (end of training, checkpoint)."""
        drained = []
        while self._next_bwd < self._next_fwd:
            loss = self._backward(self._next_bwd)
            if loss is not None:
                drained.append(loss)
        self._wait_sends()
        self._stream_start = self._next_fwd
        self._versions = {}
        if losses is not None:
            losses.clear()
            losses.extend(drained)

    # ---------------------------------------------------------------- schedule
    def _next_action(self) -> tuple[str, int]:
        warmup = self._stage.num_stages - self._stage.stage_index
        done_fwd = self._next_fwd - self._stream_start
        if done_fwd < warmup:
            return "F", self._next_fwd
        # steady state alternates B and F: a backward is due whenever `warmup` micro-batches are in flight
        if self._next_fwd - self._next_bwd >= warmup:
            return "B", self._next_bwd
        return "F", self._next_fwd

    def _slot(self, mb: int) -> int:
        return mb % self._n_microbatches

    def _split_target(self, target: Any) -> list[Any] | None:
        if target is None:
            return None
        (chunks, _) = split_args_kwargs_into_chunks((target,), None, self._n_microbatches)
        return [c[0] for c in chunks]

    # ---------------------------------------------------------------- versions
    def _params(self) -> dict[str, torch.nn.Parameter]:
        return {**dict(self._stage.submod.named_parameters()), **self.departing}

    def _held_names(self) -> set[str]:
        """Names of the parameters the stage's module holds now (cached until its layers change)."""
        layers = tuple(child_modules(self._stage.submod))
        if self._held_cache is None or self._held_cache[0] != layers:
            self._held_cache = (layers, {name for name, _ in self._stage.submod.named_parameters()})
        return self._held_cache[1]

    def _stash(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self._versions:
            if version != self.updates:
                raise RuntimeError(
                    f"stage {self._stage.stage_index}: weight version {version} is needed but was not kept "
                    f"(newest is {self.updates})"
                )
            self._versions[version] = {
                name: p.detach().clone().requires_grad_(p.requires_grad)
                for name, p in self._stage.submod.named_parameters()
            }
            self._count_versions()
        return self._versions[version]

    def _count_versions(self) -> None:
        self.peak_stashed = max(self.peak_stashed, len(self._versions))
        self.peak_versions = max(self.peak_versions, len(self.versions_held))

    def _version_for(self, mb: int) -> int:
        """The weight version micro-batch ``mb`` runs on here (a subclass's rule may differ)."""
        stage = self._stage
        return start_version(mb, stage.stage_index, stage.num_stages, self.vertical_sync)

    def _release_versions(self) -> None:
        oldest_needed = self._version_for(self._next_fwd)
        live = set(self._mb_version.values()) | {v for v in self._versions if v >= oldest_needed}
        for v in [v for v in self._versions if v not in live]:
            del self._versions[v]

    # ---------------------------------------------------------------- actions
    def _forward(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stage = self._stage
        slot = self._slot(mb)
        self._recv(stage.get_fwd_recv_ops(slot))
        for mover in self.movers:
            mover.before_forward(mb)
        version = self._version_for(mb)
        weights = self._stash(version)
        for mover in self.movers:
            mover.add_weights(version, weights)
        self._mb_version[mb] = version
        module = stage.submod
        held = self._held_names()
        if len(held) != len(weights):  # a version stashed before a move names layers that left this stage
            weights = {name: t for name, t in weights.items() if name in held}

        def run_on_version(*a: Any, **kw: Any) -> Any:
            return functional_call(module, weights, a, kw)

        # an instance attribute over torch's method, removed below (cast: mypy forbids assigning to a method)
        cast(Any, stage).forward_maybe_with_nosync = run_on_version
        try:
            output = stage.forward_one_chunk(slot, args, kwargs, save_forward_output=False)
        finally:
            del stage.forward_maybe_with_nosync
        if stage.is_last:
            self._losses[mb] = self._compute_loss(output, self._targets[mb])  # type: ignore[no-untyped-call]
        self._send(stage.get_fwd_send_ops(slot))
        self._next_fwd += 1

    def _backward(self, mb: int) -> torch.Tensor | None:
        stage = self._stage
        slot = self._slot(mb)
        self._recv(stage.get_bwd_recv_ops(slot))
        loss = self._losses.pop(mb, None)
        stage.backward_one_chunk(slot, loss=loss, last_backward=False)
        self._send(stage.get_bwd_send_ops(slot))
        for mover in self.movers:
            mover.before_update(mb)
        self._update_after(mb)
        for mover in self.movers:
            mover.after_update(self.updates)
        self.movers = [m for m in self.movers if not m.done]
        self._targets.pop(mb, None)
        self._next_bwd += 1
        self._release_versions()
        return loss.detach() if loss is not None else None

    def _update_after(self, mb: int) -> None:
        """PipeDream steps after every micro-batch's backward."""
        self._apply_update(self._versions[self._mb_version.pop(mb)])

    def _apply_update(self, weights: dict[str, torch.Tensor]) -> None:
        """Move the micro-batch's gradient from its stashed weights to the live parameters and step."""
        for name, p in self._params().items():
            stashed = weights.get(name)
            grad = stashed.grad if stashed is not None else None
            if stashed is not None:
                stashed.grad = None
            p.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        if self.vertical_sync:
            self._stash(self.updates)  # later micro-batches may start on this version

    # ---------------------------------------------------------------- p2p
    def _recv(self, ops: list[dist.P2POp]) -> None:
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _send(self, ops: list[dist.P2POp]) -> None:
        if ops:
            for work in dist.batch_isend_irecv(ops):
                self.defer_wait(work)

    def defer_wait(self, work: Any, keep_alive: Any = None) -> None:
        """Wait for ``work`` (a send) at the end of the next step, keeping ``keep_alive`` until then."""
        self._send_work.append((self._steps, work, keep_alive))

    def _wait_sends(self, before_step: int | None = None) -> None:
        """Wait for the sends issued before step ``before_step`` (all of them when None)."""
        keep = []
        for step, work, alive in self._send_work:
            if before_step is None or step < before_step:
                work.wait()
            else:
                keep.append((step, work, alive))
        self._send_work = keep
