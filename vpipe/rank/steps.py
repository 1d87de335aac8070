"""The step boundary of the user's loop, where vpipe acts: around
``schedule.step``, or at ``optimizer.step()``.

With a pipelining schedule, ``schedule.step`` is wrapped as an instance attribute: plans
due at this step are applied before it starts (after the user's ``optimizer.step()`` of the
previous one), and the step is monitored. A hand-written loop has no schedule: its stage
module's forwards are counted as micro-batches, and the optimizer's ``step()`` (a
post-hook) ends one step and begins the next. A step whose micro-batches would all be quiet
(see ``QuietPath.for_a_step`` in ``vpipe.tensor_manager.quiet``) runs the pipelining stages' own methods: the
wrappers are set aside at its start and come back for the first step that needs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from vpipe import timeline
from vpipe.log import step_record
from vpipe.rank.applying import PlanApplier
from vpipe.rank.boundary import PlanBoundary
from vpipe.rank.memory import apply_budgets
from vpipe.rank.metrics import MetricsWriter
from vpipe.rank.parts import RankParts
from vpipe.rank.tracing import TraceWindow
from vpipe.stage.batch_norm import DeferredNorms
from vpipe.tensor_manager import HostPoolFullError, MemoryBudgetError, TensorManager
from vpipe.tensor_manager.layers import input_shapes
from vpipe.tensor_manager.pipelining import StageHandle

__all__ = ["StepDriver", "MicroBatchCounter"]

# The tensor managers measure what each layer saves on the monitor's first sampled step and on every n-th one
# after: the bytes stay what they were until shapes change, and measuring every call costs a few per cent of a
# small model's step. (Steps with a swap, a recompute or a tight budget are measured whatever this says.)
_METER_EVERY_SAMPLES = 5


class StepDriver:
    """Counts steps, applies due plans at each boundary, monitors each step, hands arriving plans on.

    ``counter``: a hand-written loop's micro-batch counter (None under a schedule, whose
    actions number the micro-batches). ``norms``: the deferred BatchNorms (``deferred_batch_norm=``), told
    when a step's forwards are over, so that their running statistics take that step's one update.
    """

    def __init__(self, parts: RankParts, *, boundary: PlanBoundary, applier: PlanApplier, micro_batches: int,
                 logs_steps: bool, counter: MicroBatchCounter | None = None,
                 stage_handles: Mapping[int, StageHandle] | None = None, trace: TraceWindow | None = None,
                 metrics: MetricsWriter | None = None, norms: DeferredNorms | None = None) -> None:
        self.parts = parts
        self.session = parts.session
        self.boundary = boundary
        self.applier = applier
        self.tensor_managers = parts.tensor_managers
        self.micro_batches = micro_batches
        self.logs_steps = logs_steps  # the rank of the last stage: its pace is the pipeline's
        self.iteration = 0
        self.in_step = False
        self.boundary_s: list[float] = []  # seconds spent applying plans before each step (the move stall)
        self._boundary_at: float | None = None
        self.counter = counter
        self._samples = 0
        # the pipelining stages' wrappers, set aside for the steps where their managers have nothing to do
        self.stage_handles = dict(stage_handles or {})
        self._input_shapes: tuple[Any, ...] | None = None  # of the last step's inputs
        self.trace = trace  # the timeline window (trace_steps), if any
        self.metrics = metrics  # per-step scalars for TensorBoard / W&B (metrics=), if any
        self.norms = norms
        self._step_started = time.perf_counter()

    def begin(self) -> None:
        if self.trace is not None:
            self.trace.begin_step(self.iteration)
        self.session.begin_step(self.iteration)
        self._step_started = time.perf_counter()
        sampled = self.session.is_sampled(self.iteration)
        metering = sampled and self._samples % _METER_EVERY_SAMPLES == 0
        self._samples += sampled
        for manager in self.tensor_managers.values():
            manager.metering = metering

    def run(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One ``schedule.step`` under vpipe."""
        self.at_boundary()
        self.begin()
        if self.counter is not None:  # a DeepSpeed engine's forwards are counted: its train_batch is a step
            self.counter.reset()
        self._set_aside_quiet_wrappers(args, kwargs)
        self.in_step = True
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            self.session.abort_step()
            own = _own_error(exc)
            if own is not None:  # torch wraps it in "[Stage k] failed to run forward": say what vpipe found
                raise own from None
            raise
        finally:
            self.in_step = False
        if self.norms is not None:  # every forward the step runs has run
            self.norms.step_done()
        # a flush schedule's step ran every backward: nothing is left in flight
        if not self.parts.engine.streams:
            for manager in self.tensor_managers.values():
                manager.end_of_step()
        self.received(self.session.end_step())
        self._step_ended()
        self.iteration += 1
        return result

    def module_step_done(self) -> None:
        """A hand-written loop's ``optimizer.step()``: the step is over, the next begins."""
        if self.counter is not None:
            self.counter.reset()
        if self.norms is not None:
            self.norms.step_done()
        for manager in self.tensor_managers.values():
            manager.end_of_step()  # a hand-written loop tells the manager of no backward
        self.received(self.session.end_step())
        self._step_ended()
        self.iteration += 1
        self.at_boundary()
        self.begin()

    def _step_ended(self) -> None:
        if self.trace is not None:
            self.trace.end_step(self.iteration)
        if self.metrics is not None:
            layer_manager = self.parts.layer_manager
            stages = {stage.index: (len(layer_manager.layers_of(stage.index)),
                                    self.tensor_managers.get(stage.index))
                      for stage in self.parts.pipeline.stages}
            in_force = self.parts.plan_in_force.plan
            self.metrics.step(self.iteration, time.perf_counter() - self._step_started, in_force.epoch,
                              stages, self.session.last_records, in_force.stage_speeds)

    def _set_aside_quiet_wrappers(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Let each stage whose manager has nothing to do this step
        run its micro-batches without vpipe's calls."""
        if not self.stage_handles:
            return
        shapes = input_shapes((*args, *kwargs.values()))
        same_inputs, self._input_shapes = shapes == self._input_shapes, shapes
        stream = self.parts.engine.stream
        moving = stream is not None and bool(stream.movers)  # a streamed move switches layers mid-step
        # a step inside the timeline's window goes through the
        # wrappers: they record its forwards and backwards
        keep_wrappers = moving or timeline.recording()
        for index, handle in self.stage_handles.items():
            manager, was_plain = handle.manager, handle.plain
            handle.run_plain(not keep_wrappers and manager.quiet.for_a_step(same_inputs,
                                                                            stream=stream is not None))
            if stream is None or handle.plain == was_plain:
                continue
            # a stream's micro-batches stay in flight across steps: counted while the manager sees their
            # backwards, not while the stage runs without it
            if handle.plain:
                manager.quiet.forget_in_flight()
            else:
                manager.quiet.count_in_flight(stream.in_flight_chunks_of(index))

    def received(self, plans: list[Any]) -> None:
        self.boundary.received(plans, self.iteration, self.parts.plan_in_force.epoch)

    def at_boundary(self) -> None:
        if self.trace is not None:
            self.trace.begin_step(self.iteration)
        started = time.perf_counter()
        if self._boundary_at is not None and self.logs_steps:
            step_record(self.iteration - 1, started - self._boundary_at,
                        stage=self.parts.pipeline.stages[-1].index,
                        micro_batches=self.micro_batches, layers=len(self.parts.layer_manager.layer_ids))
        self._boundary_at = started
        step = self.boundary.applying_step(self.iteration)
        for plan in self.boundary.due(self.iteration):
            with timeline.span("vpipe.apply_plan", timeline.PLAN, timeline.RANK_TRACK, epoch=plan.epoch,
                               step=step,
                               stage_speeds=None if plan.stage_speeds is None else list(plan.stage_speeds)):
                self.applier.apply(plan, step, self.micro_batches)
        # the optimizer state may have grown, a stage sharing the rank may have measured what it needs
        apply_budgets(self.tensor_managers, self.parts.memories, self.parts.plan_in_force.epoch)
        self.applier.continue_streamed(step, self.micro_batches)
        self.boundary_s.append(time.perf_counter() - started)


def _own_error(exc: BaseException) -> BaseException | None:
    """The tensor manager's own error (budget, host pool) inside
    ``exc``'s cause chain, if ``exc`` wraps one."""
    seen: set[int] = set()
    cause = exc.__cause__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (MemoryBudgetError, HostPoolFullError)):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__
    return None


class MicroBatchCounter:
    """For hand-written loops: the n-th forward of the stage module since the last step is micro-batch n."""

    def __init__(self, module: nn.Module, manager: TensorManager) -> None:
        self.manager = manager
        self.next_mb = 0
        self._open: Any = None
        self._handles = [module.register_forward_pre_hook(self._pre),
                         module.register_forward_hook(self._post)]

    def _pre(self, _module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._open = self.manager.micro_batch(self.next_mb, tuple(args))
            self._open.__enter__()

    def _post(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
            self.next_mb += 1

    def reset(self) -> None:
        self.next_mb = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
