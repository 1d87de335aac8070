"""One rank's monitors, control plane and agent, held together around a training loop.

This is the part of vPipe a trainer sees: build a :class:`ControlSession` once per rank
(one monitor per stage the rank runs: one, or several under a multi-stage schedule), wrap
each step in :meth:`ControlSession.step` (or call ``begin_step``/``end_step``), use the
plans it returns, and :meth:`ControlSession.close` at the end (which drains the last stats
to the planner). ``vpipe.attach`` holds one; the reference trainer's monitoring-only runs
use :func:`open_for_stage_run`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vpipe.compat.torch_distributed import wrap_shape_inference
from vpipe.control.agent import StageAgent
from vpipe.control.channel import FROM_SETTINGS, ControlPlane
from vpipe.control.curve import RunKeys
from vpipe.control.daemon import NO_CHANGE_PLANNER
from vpipe.control.planner_link import PlannerLink
from vpipe.control.run_key import agree_run_key
from vpipe.monitors.pulse import StagePulse
from vpipe.monitors.sampling import SampleSchedule
from vpipe.monitors.source import LayerFacts, SavedTensorSource
from vpipe.monitors.stage import StageMonitor, layers_of
from vpipe.plan import Plan

log = logging.getLogger("vpipe.control")

__all__ = ["ControlOptions", "ControlSession", "StepPlans", "open_for_stage_run", "exclude_shape_inference"]


@dataclass(frozen=True)
class ControlOptions:
    """How a session samples and plans. ``planner=None``: start no daemon, wait for ``vpipe planner``.

    ``planner_config`` (plain JSON values) goes to the daemon's planner as ``--planner-config``.
    ``control_host`` and ``keys`` are the settings' (None: this process's settings, read once)."""

    sample_every: int = 10
    max_sample_every: int | None = None  # back off to this while nothing changes (None: a fixed interval)
    planner: str | None = NO_CHANGE_PLANNER
    planner_config: Mapping[str, Any] | None = None
    planner_timeout_s: float = 5.0  # attach passes VPIPE_PLANNER_TIMEOUT's (vpipe.settings)
    heartbeat_s: float = 0.5
    finish_timeout_s: float = 60.0
    pulse: bool = True  # time the stage modules' forwards every step, to notice a device or workload change
    log_file: str | None = None
    # where the inbox binds (VPIPE_CONTROL_HOST); None: the process's settings'
    control_host: str | None = None
    keys: RunKeys | None = None  # the attach's CURVE keys; None: the process's settings'


@dataclass
class StepPlans:
    """Handle of :meth:`ControlSession.step`: the plans that arrived, set when the block ends."""

    iteration: int
    plans: list[Plan] = field(default_factory=list)


def exclude_shape_inference(stage: Any, monitor: StageMonitor) -> Callable[[], None] | None:
    """Hide a PipelineStage's first-step shape inference from ``monitor``; returns an undo, or None.

    torch's schedules run the stage's forward (and backward) once on empty tensors inside the
    first ``step()``; those calls go through ``_prepare_forward_infra`` / ``_prepare_backward_infra``,
    which are wrapped here as instance attributes (the stage object is left otherwise untouched).
    """
    return wrap_shape_inference(stage, monitor.suspended)


class ControlSession:
    """Monitors (one per stage this rank runs) + control plane + agent (+ the planner daemon's link on the
    last rank).

    ``layer_facts`` tells the monitors the layers' order and kinds; ``stage_modules`` are the stage modules
    whose modules outside the blocks the monitors time too; ``combine_records`` turns a step's sampled
    records into what goes down the chain (data-parallel replicas: the slowest, fullest per stage);
    ``pulse_modules`` (the rank's stage modules) are timed on every step (:mod:`vpipe.monitors.pulse`).
    Whoever applies plans tells the session of the plan in force (:meth:`plan_changed`).
    """

    def __init__(
        self,
        stages: Mapping[int, Mapping[int, nn.Module]],
        *,
        rank: int,
        stage_ranks: Sequence[int],
        store: Any,
        world_size: int,
        device: torch.device | str,
        optimizer: torch.optim.Optimizer | None = None,
        saved_sources: Mapping[int, SavedTensorSource] | None = None,
        plan: Plan | None = None,
        options: ControlOptions | None = None,
        pipeline_stages: Mapping[int, Any] | None = None,
        layer_facts: LayerFacts | None = None,
        stage_modules: Mapping[int, nn.Module] | None = None,
        combine_records: Callable[[int, list[Any]], list[Any]] | None = None,
        pulse_modules: Sequence[nn.Module] = (),
    ) -> None:
        self.options = options or ControlOptions()
        self.stage_index = rank
        sources = saved_sources or {}
        schedule = SampleSchedule(self.options.sample_every, max_every=self.options.max_sample_every)
        whole = stage_modules or {}
        with ExitStack() as made:  # what is open so far, closed again if the session cannot be made whole
            self.monitors: dict[int, StageMonitor] = {}
            for v, layers in sorted(stages.items()):
                self.monitors[v] = monitor = StageMonitor(
                    layers, stage_index=v, device=device, optimizer=optimizer, schedule=schedule,
                    saved_source=sources.get(v), facts=layer_facts, stage_module=whole.get(v))
                made.callback(monitor.close)
            self.plane = ControlPlane(store, rank, world_size, host=self.options.control_host,
                                      curve=FROM_SETTINGS if self.options.keys is None
                                      else self.options.keys.curve())
            made.callback(self.plane.close)
            num_stages = len(stage_ranks)
            link = None
            if rank == max(stage_ranks):
                link = PlannerLink(self.plane, stage_index=rank, num_stages=num_stages,
                                   timeout_s=self.options.planner_timeout_s,
                                   heartbeat_s=self.options.heartbeat_s,
                                   log_file=self.options.log_file, keys=self.options.keys)
                made.callback(link.close, 0.0)
            self.agent = StageAgent(self.plane, stage_index=rank, num_stages=num_stages, plan=plan,
                                    planner=link,
                                    stage_ranks=stage_ranks)
            # every step's forward time of the stage modules: a change
            # asks the planner to have every rank measure again
            self.pulse = StagePulse(pulse_modules, device) if pulse_modules and self.options.pulse else None
            if self.pulse is not None:
                made.callback(self.pulse.close)
            self._pulse_interval = 0
            self._undo_wraps = []
            for v, stage in (pipeline_stages or {}).items():
                undo = exclude_shape_inference(stage, self.monitors[v])
                # without the wrap, the first step's shape inference would pollute its record: drop that one
                self._distrust_first = undo is None
                if undo is not None:
                    self._undo_wraps.append(undo)
                    made.callback(undo)
            self._steps = 0
            self.combine_records = combine_records
            # the StageRecords of the last step this rank sampled (else empty)
            self.last_records: list[Any] = []
            self._changed = False  # a plan or an edit took effect: sample at the base rate again
            self._open: int | None = None
            self._closed = False
            if link is not None and self.options.planner:
                link.start(self.options.planner, self.options.planner_config)
            made.pop_all()  # whole: close() undoes it from now on

    _distrust_first = False

    @property
    def monitor(self) -> StageMonitor:
        """The monitor of a rank that runs one stage."""
        if len(self.monitors) != 1:
            raise ValueError(f"rank {self.stage_index} runs stages "
                             f"{sorted(self.monitors)}: use monitors[stage]")
        return next(iter(self.monitors.values()))

    def is_sampled(self, iteration: int) -> bool:
        return next(iter(self.monitors.values())).is_sampled(iteration)

    @property
    def plan(self) -> Plan | None:
        return self.agent.plan

    def plan_changed(self, plan: Plan, cause: str) -> None:
        """A plan took effect (every rank at the same step boundary): the agent holds it, the records carry
        its epoch, and a new epoch restarts sampling at the base rate."""
        self.agent.plan_changed(plan)
        new_epoch = any(monitor.epoch != plan.epoch for monitor in self.monitors.values())
        self._changed |= new_epoch
        for monitor in self.monitors.values():
            monitor.plan_changed(plan)
        if new_epoch and self.pulse is not None:
            self.pulse.restart()

    def begin_step(self, iteration: int) -> None:
        if self._changed:  # measure the change's effect at the base rate
            self._changed = False
            for monitor in self.monitors.values():
                monitor.schedule.restart(iteration)
        for monitor in self.monitors.values():
            monitor.begin_iteration(iteration)
        if self.pulse is not None:
            # a new sampling interval changes what runs beside the steps (the planner's turns on a shared
            # host): the pulse skips a step there, keeping its level (and a change that came with it)
            interval = next(iter(self.monitors.values())).schedule.interval_at(iteration)
            if interval != self._pulse_interval:
                self._pulse_interval = interval
                self.pulse.pause()
            self.pulse.begin_step(self.is_sampled(iteration))
        self._open = iteration

    def abort_step(self) -> None:
        for monitor in self.monitors.values():
            monitor.abort_iteration()
        self._open = None

    def end_step(self) -> list[Plan]:
        """Finish the step's records (if sampled), exchange control messages, return new plans."""
        if self._open is None:
            raise RuntimeError("end_step() without begin_step()")
        iteration, self._open = self._open, None
        records = [r for r in (m.end_iteration() for m in self.monitors.values()) if r is not None]
        if self._distrust_first and self._steps == 0:
            records = []
        self._steps += 1
        if self.combine_records is not None:
            records = self.combine_records(iteration, records)
        self.last_records = records
        change = self.pulse.end_step() if self.pulse is not None else None
        if change is not None:
            log.info("rank %d: %s at step %d; asking the planner to measure again", self.stage_index,
                     change.what,
                     iteration)
            self.agent.alert(iteration, min(self.monitors), change.what, change.ratio)
        return self.agent.after_step(iteration, records)

    @contextmanager
    def step(self, iteration: int) -> Iterator[StepPlans]:
        result = StepPlans(iteration)
        self.begin_step(iteration)
        try:
            yield result
        except BaseException:
            self.abort_step()
            raise
        result.plans = self.end_step()

    def close(self, timeout_s: float | None = None) -> list[Plan]:
        """End of training: drain stats to the planner, stop the daemon, remove every hook."""
        if self._closed:
            return []
        self._closed = True
        try:
            return self.agent.finish(self.options.finish_timeout_s if timeout_s is None else timeout_s)
        finally:
            for undo in self._undo_wraps:
                undo()
            for monitor in self.monitors.values():
                monitor.close()
            if self.pulse is not None:
                self.pulse.close()
            self.plane.close()


def open_for_stage_run(run: Any, ctx: Any, options: ControlOptions) -> ControlSession:
    """A session for one rank of the reference trainer (a ``StageRun`` and its ``Distributed``): one
    monitor per stage the rank runs."""
    cfg = run.cfg
    keys = options.keys if options.keys is not None else RunKeys.of_process()
    agree_run_key(dist.PrefixStore("vpipe/run-key/", ctx.store), rank=ctx.rank, world_size=ctx.world_size,
                  timeout_s=120.0, who=f"rank {ctx.rank}", keys=keys)
    options = replace(options, keys=keys)
    plan = Plan.from_counts(range(cfg.n_layers), cfg.layer_counts(), epoch=0)
    return ControlSession(
        {v: layers_of(module) for v, module in zip(run.stage_indices, run.modules)}, rank=ctx.rank,
        stage_ranks=[cfg.stage_rank(v) for v in range(cfg.virtual_stages)], store=ctx.store,
        world_size=ctx.world_size, device=ctx.device, optimizer=run.optimizer, plan=plan, options=options,
        pipeline_stages=dict(zip(run.stage_indices, run.stages)),
    )
