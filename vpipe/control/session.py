"""One stage's monitor, control plane and agent, held together around a training loop.

This is the part of vPipe a trainer sees: build a :class:`ControlSession` once per rank,
wrap each step in :meth:`ControlSession.step` (or call ``begin_step``/``end_step``), use
the plans it returns, and :meth:`ControlSession.close` at the end (which drains the last
stats to the planner). The reference trainer uses it through :func:`open_for_stage_run`;
``vpipe.attach`` is meant to hold one too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from typing import Any

import torch
from torch import nn

from vpipe.control.agent import StageAgent
from vpipe.control.channel import ControlPlane
from vpipe.control.daemon import DEFAULT_PLANNER
from vpipe.control.planner_link import PlannerLink
from vpipe.monitors.source import SavedTensorSource
from vpipe.monitors.stage import StageMonitor, layers_of
from vpipe.planner.plan import Plan

__all__ = ["ControlOptions", "ControlSession", "StepPlans", "open_for_stage_run", "exclude_shape_inference"]


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {os.environ[name]!r}") from None


@dataclass(frozen=True)
class ControlOptions:
    """How a session samples and plans. ``planner=None``: start no daemon, wait for ``vpipe planner``."""

    sample_every: int = 10
    planner: str | None = DEFAULT_PLANNER
    planner_timeout_s: float = field(default_factory=lambda: _env_float("VPIPE_PLANNER_TIMEOUT", 5.0))
    heartbeat_s: float = 0.5
    finish_timeout_s: float = 60.0
    log_file: str | None = None


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
    names = [n for n in ("_prepare_forward_infra", "_prepare_backward_infra") if callable(getattr(stage, n, None))]
    if len(names) != 2:
        return None
    for name in names:
        original = getattr(stage, name)

        def suspended(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            with monitor.suspended():
                return _original(*args, **kwargs)

        setattr(stage, name, wraps(original)(suspended))

    def undo() -> None:
        for n in names:
            stage.__dict__.pop(n, None)

    return undo


class ControlSession:
    """Monitor + control plane + agent (+ the planner daemon's link on the last stage)."""

    def __init__(
        self,
        layers: Mapping[int, nn.Module],
        *,
        stage_index: int,
        num_stages: int,
        store: Any,
        rank: int,
        world_size: int,
        device: torch.device | str,
        optimizer: torch.optim.Optimizer | None = None,
        saved_source: SavedTensorSource | None = None,
        plan: Plan | None = None,
        options: ControlOptions | None = None,
        pipeline_stage: Any = None,
    ) -> None:
        self.options = options or ControlOptions()
        self.stage_index = stage_index
        self.monitor = StageMonitor(layers, stage_index=stage_index, device=device, optimizer=optimizer,
                                    sample_every=self.options.sample_every, saved_source=saved_source)
        self.plane = ControlPlane(store, rank, world_size)
        link = None
        if stage_index == num_stages - 1:
            link = PlannerLink(self.plane, stage_index=stage_index, num_stages=num_stages,
                               timeout_s=self.options.planner_timeout_s, heartbeat_s=self.options.heartbeat_s,
                               log_file=self.options.log_file)
        self.agent = StageAgent(self.plane, stage_index=stage_index, num_stages=num_stages, plan=plan, planner=link)
        self._undo_wrap = exclude_shape_inference(pipeline_stage, self.monitor) if pipeline_stage is not None else None
        # without the wrap, the first step's shape inference would pollute its record: drop that one
        self._distrust_first = pipeline_stage is not None and self._undo_wrap is None
        self._steps = 0
        self._open: int | None = None
        self._closed = False
        if link is not None and self.options.planner:
            link.start(self.options.planner)

    @property
    def plan(self) -> Plan | None:
        return self.agent.plan

    def begin_step(self, iteration: int) -> None:
        self.monitor.begin_iteration(iteration)
        self._open = iteration

    def end_step(self) -> list[Plan]:
        """Finish the step's record (if sampled), exchange control messages, return new plans."""
        if self._open is None:
            raise RuntimeError("end_step() without begin_step()")
        iteration, self._open = self._open, None
        record = self.monitor.end_iteration()
        if self._distrust_first and self._steps == 0:
            record = None
        self._steps += 1
        return self.agent.after_step(iteration, record)

    @contextmanager
    def step(self, iteration: int) -> Iterator[StepPlans]:
        result = StepPlans(iteration)
        self.begin_step(iteration)
        try:
            yield result
        except BaseException:
            self.monitor.abort_iteration()
            self._open = None
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
            if self._undo_wrap is not None:
                self._undo_wrap()
            self.monitor.close()
            self.plane.close()


def open_for_stage_run(run: Any, ctx: Any, options: ControlOptions) -> ControlSession:
    """A session for one rank of the reference trainer (a ``StageRun`` and its ``Distributed``)."""
    cfg = run.cfg
    plan = Plan.from_counts(range(cfg.n_layers), cfg.layer_counts(), epoch=0)
    return ControlSession(
        layers_of(run.module), stage_index=run.stage_index, num_stages=cfg.stages, store=ctx.store,
        rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, optimizer=run.optimizer, plan=plan,
        options=options, pipeline_stage=run.stage,
    )
