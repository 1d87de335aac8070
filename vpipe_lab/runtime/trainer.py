"""The reference trainer: a reference model on a ``torch.distributed.pipelining`` pipeline.

It is what ``vpipe train`` and ``vpipe demo`` run, what the tests compare against
single-process references, and what the benchmarks measure. One call of
:func:`train_rank` is one rank: one stage, or several virtual stages under a multi-stage
schedule (Interleaved 1F1B, LoopedBFS, the zero-bubble schedules; :mod:`vpipe_lab.runtime.layout`).

This module runs the steps and puts vpipe on the rank; building the rank's stages is
:mod:`vpipe_lab.runtime.stage_run`, its checkpoints and resuming :mod:`vpipe_lab.runtime.checkpoints`,
and what it reports :mod:`vpipe_lab.runtime.results`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from vpipe._attach import DEFAULT_PLANNER, VpipeConfig, attach
from vpipe.checkpoint import restore_stage
from vpipe.control.curve import RunKeys
from vpipe.control.session import ControlOptions, open_for_stage_run
from vpipe.plan import Plan, Policy
from vpipe.settings import Settings, process_settings
from vpipe_lab.runtime.checkpoints import (
    check_checkpoint_dir,
    load_resume,
    resume_placement,
    save_run_checkpoint,
)
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.launch import Distributed
from vpipe_lab.runtime.models import block_spec, build_layer
from vpipe_lab.runtime.optim import make_optimizer
from vpipe_lab.runtime.outputs import claim_outputs
from vpipe_lab.runtime.results import RunProgress, RunResult, print_summary, save_rank_result
from vpipe_lab.runtime.stage_run import StageRun, build_stage_run

log = logging.getLogger("vpipe.runtime")  # the run log keeps vpipe.* loggers

# StageRun, build_stage_run, make_optimizer and RunResult live in their own modules; the trainer's names
__all__ = ["StageRun", "build_stage_run", "train_rank", "attach_vpipe", "make_optimizer", "RunResult"]


def train_rank(cfg: RunConfig, ctx: Distributed) -> RunResult:
    """Train ``cfg.steps`` steps as rank ``ctx.rank`` (its stage, or its virtual stages); save results to
    ``cfg.out_dir`` if set."""
    if ctx.world_size != cfg.stages:
        raise ValueError(f"the run has {ctx.world_size} ranks but the config asks for {cfg.stages} "
                         f"{'ranks' if cfg.multi_stage else 'stages'}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # the rank's VPIPE_* variables, read once per process (attach takes the same)
    settings = process_settings()
    if ctx.rank == 0:  # the locks of the run's directories and log, for as long as the run lives
        check_checkpoint_dir(cfg, hold=True)
        claim_outputs(cfg, hold=True)
    resumed = load_resume(cfg) if cfg.resume else None
    placement = resume_placement(cfg, resumed) if resumed is not None else None
    run = build_stage_run(cfg, ctx.rank, ctx.device, placement=placement)
    first_step = 0
    if resumed is not None:
        # the RNG stream is a rank's: it continues only where the same rank runs the same stages
        same_layout = resumed.num_stages == cfg.virtual_stages and len(resumed.shards) == cfg.stages
        restore_stage(resumed, run.layers_view(), run.optimizer, run.scheduler,
                      rank=ctx.rank if same_layout else None)
        first_step = resumed.step
        log.info("stage %d: resumed from %s after step %d", ctx.rank, resumed.path, first_step)
    log.info("rank %d of %d: stages %s of %d, training layers %s with %s", ctx.rank, cfg.stages,
             run.stage_indices,
             cfg.virtual_stages, run.layer_ids, cfg.schedule, extra={"vpipe_fields": {"pid": os.getpid()}})
    vp = attach_vpipe(cfg, run, resumed.vpipe if resumed is not None else None) if cfg.vpipe else None
    session = _control_session(cfg, run, ctx, settings) if vp is None else None
    result = RunResult(steps=0, seconds=0.0)
    progress = RunProgress(cfg, enabled=cfg.progress and run.is_last)
    now = {"step": first_step}
    settings.faults.install_kill(run.modules[0], ctx.rank, lambda: now["step"])  # only when VPIPE_FAULTS asks
    start = time.perf_counter()
    with progress:
        for step in range(first_step, cfg.steps):
            now["step"] = step
            if session is not None:
                session.begin_step(step)
            step_start = time.perf_counter()
            if vp is not None:
                apply_layer_edits(cfg, vp, step)
            losses = run.run_step(step)
            result.step_s.append(time.perf_counter() - step_start)
            if session is not None:
                session.end_step()  # plans are logged; applying them is the layer manager's job
            result.steps += 1
            if losses:
                result.losses.append(float(torch.stack([loss.detach() for loss in losses]).mean()))
            progress.update(step, result, time.perf_counter() - start)
            if cfg.checkpoint_dir and (step + 1 == cfg.steps or (cfg.checkpoint_every
                                                                 and (step + 1) % cfg.checkpoint_every == 0)):
                save_run_checkpoint(cfg, run, ctx, vp, steps_done=step + 1,
                                    placement=placement or cfg.stage_layer_ids())
        if run.streams:
            run.schedule.flush()
    result.seconds = time.perf_counter() - start
    if session is not None:
        session.close()
    if vp is not None:
        result.memory = vp.memory_report()
        vp.detach()
        result.boundary_s = list(vp.boundary_s)
    if cfg.out_dir:
        save_rank_result(cfg, run, result)
    if run.is_last and cfg.progress:
        print_summary(cfg, result)
    return result


def attach_vpipe(cfg: RunConfig, run: StageRun, resume_state: dict[str, Any] | None = None,
                  **overrides: Any) -> Any:
    """vpipe on this rank of the reference trainer, with the forced moves of ``cfg.moves`` requested.

    On resume the vpipe state is restored first, and only moves still ahead are requested,
    with epochs after the restored one. ``overrides`` set further :class:`VpipeConfig` fields."""
    spec = cfg.model_spec()
    config = VpipeConfig(
        memory_budget=cfg.memory_budget,
        planning=cfg.planning and cfg.planner is not None,
        planner=cfg.planner or DEFAULT_PLANNER,
        sample_every=cfg.monitor_every or 10,
        layer_factory=lambda lid, layer_spec: build_layer(layer_spec, lid, cfg.seed),
        specs=dict(enumerate(spec.layers)),
        policies={lid: Policy(cfg.policy) for lid in range(cfg.n_layers)},
        log_file=cfg.log_file,
        **overrides,
    )
    vp = attach(run.schedule, optimizer=run.optimizer, config=config)
    if resume_state is not None:
        vp.load_state_dict(resume_state)
    order = list(range(cfg.n_layers))
    ahead = [move for move in cfg.moves or [] if move["step"] >= vp.iteration]
    for i, move in enumerate(ahead):
        vp.request_plan(Plan.from_counts(order, move["partition"], epoch=vp.layer_manager.epoch + 1 + i),
                        at_step=move["step"])
    return vp


def apply_layer_edits(cfg: RunConfig, vp: Any, step: int) -> None:
    """The layer additions and removals ``cfg.nas`` schedules before ``step`` (every rank alike)."""
    for event in cfg.nas or []:
        if event["step"] != step:
            continue
        if "add" in event:
            add = event["add"]
            specs = [block_spec(t, cfg.d_model, cfg.n_heads, 4 * cfg.d_model, cfg.dropout)
                     for t in add["types"]]
            vp.add_layers(add["position"], specs)
        else:
            vp.remove_layers(event["remove"])


def _control_session(cfg: RunConfig, run: StageRun, ctx: Distributed, settings: Settings) -> Any:
    """The monitor + control plane session of this rank, when ``cfg.monitor_every`` asks for one."""
    if not cfg.monitor_every:
        return None
    options = ControlOptions(sample_every=cfg.monitor_every, planner=cfg.planner, log_file=cfg.log_file,
                             planner_timeout_s=settings.planner_timeout_s, control_host=settings.control_host,
                             keys=RunKeys(settings))
    return open_for_stage_run(run, ctx, options)
