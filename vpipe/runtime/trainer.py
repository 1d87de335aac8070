"""The reference trainer: a reference model on a ``torch.distributed.pipelining`` pipeline.

It is what ``vpipe train`` and ``vpipe demo`` run, what the tests compare against
single-process references, and what the benchmarks measure. One call of
:func:`train_rank` is one rank: one stage, or several virtual stages under a multi-stage
schedule (Interleaved 1F1B, LoopedBFS, the zero-bubble schedules; :mod:`vpipe.runtime.layout`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from torch import nn
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from vpipe import faults
from vpipe.attach import VpipeConfig, attach
from vpipe.checkpoint import (VERSION, CheckpointError, holds_checkpoints, load_checkpoint, restore_stage,
                              save_checkpoint, skipped_newer)
from vpipe.control.session import ControlOptions, open_for_stage_run
from vpipe.plan import Plan, Policy
from vpipe.runtime.config import RunConfig
from vpipe.runtime.launch import Distributed
from vpipe.runtime.models import block_spec, build_layer, build_model
from vpipe.runtime.optim import make_optimizer, make_scheduler
from vpipe.runtime.reference import optimizer_state_by_name
from vpipe.schedules.pipedream import SchedulePipeDream

log = logging.getLogger("vpipe.runtime")

__all__ = ["StageRun", "build_stage_run", "train_rank", "make_optimizer", "RunResult"]


@dataclass
class StageRun:
    """Everything one rank holds: one chunk per stage it runs (one, or several virtual stages under a
    multi-stage schedule), their torch stages, the schedule and one optimizer over every chunk."""

    cfg: RunConfig
    rank: int
    stage_indices: list[int]  # the stages this rank runs, in model order
    modules: list[nn.Sequential]  # one chunk per stage, children named by global layer id
    stages: list[PipelineStage]
    schedule: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    @property
    def stage_index(self) -> int:
        """The first stage this rank runs (its only one under a single-stage schedule)."""
        return self.stage_indices[0]

    @property
    def module(self) -> nn.Sequential:
        """This rank's only chunk; under a multi-stage schedule use :attr:`modules` or :meth:`layers_view`."""
        if len(self.modules) != 1:
            raise ValueError(f"rank {self.rank} runs stages {self.stage_indices}: use modules[i] or layers_view()")
        return self.modules[0]

    @property
    def stage(self) -> PipelineStage:
        """This rank's only torch stage; under a multi-stage schedule use :attr:`stages`."""
        if len(self.stages) != 1:
            raise ValueError(f"rank {self.rank} runs stages {self.stage_indices}: use stages[i]")
        return self.stages[0]

    @property
    def layer_ids(self) -> list[int]:
        """The layers this rank holds now (after any moves), chunk by chunk."""
        return [int(name) for module in self.modules for name in module._modules]

    def layers_view(self) -> nn.Sequential:
        """Every layer of this rank in one ``Sequential`` named by global layer id: the chunks' own modules,
        not copies, so checkpoints and results save and load them by the same names on any layout."""
        if len(self.modules) == 1:
            return self.modules[0]
        return nn.Sequential(OrderedDict((name, layer) for module in self.modules
                                         for name, layer in module._modules.items()))

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.cfg.virtual_stages - 1 in self.stage_indices

    def step_inputs(self, step: int) -> tuple[tuple[Any, ...], Any]:
        """(args for schedule.step, target) of this rank for one step."""
        x, y = self.cfg.model_spec().batch(step, self.cfg.batch_size, self.cfg.seed)
        return ((x,) if self.is_first else ()), (y if self.is_last else None)

    def run_step(self, step: int) -> list[torch.Tensor]:
        """One training step; returns the micro-batch losses on the rank of the last stage (else empty)."""
        args, target = self.step_inputs(step)
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=target, losses=losses if self.is_last else None)
        if not isinstance(self.schedule, SchedulePipeDream):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return losses


def build_stage_run(cfg: RunConfig, rank: int, device: torch.device, group: Any = None,
                    placement: list[list[int]] | None = None) -> StageRun:
    """Rank ``rank`` of ``cfg``: its stages with the layers ``placement`` gives them (the layer ids of every
    stage; default: the config's initial partition), the schedule and one optimizer."""
    spec = cfg.model_spec()
    placement = cfg.stage_layer_ids() if placement is None else placement
    # Dropout draws from this rank's RNG stream: seeded, so a run repeats exactly for a given
    # placement (masks follow the stage, not the layer, so moved layers draw different masks).
    torch.manual_seed(cfg.seed * 1_000_003 + 7919 * (rank + 1))
    indices = cfg.rank_stages(rank)
    modules = [build_model(_sub_spec(spec, placement[v]), seed=cfg.seed, ids=list(placement[v])).to(device)
               for v in indices]
    stages = [PipelineStage(module, v, cfg.virtual_stages, device, group=group) for module, v in zip(modules, indices)]
    optimizer = make_optimizer(cfg, [p for module in modules for p in module.parameters()])
    schedule = _schedule(cfg, stages, spec.loss_fn(), optimizer)
    return StageRun(cfg, rank, indices, modules, stages, schedule, optimizer, make_scheduler(cfg, optimizer))


def multi_stage_class(schedule: str) -> type:
    """torch's schedule class for one of the multi-stage schedule names (``interleaved1f1b`` ...)."""
    if schedule not in _MULTI_STAGE_CLASSES:
        raise ValueError(f"{schedule!r} is not a multi-stage schedule")
    return _MULTI_STAGE_CLASSES[schedule]


_MULTI_STAGE_CLASSES: dict[str, type] = {
    "interleaved1f1b": pipelining.ScheduleInterleaved1F1B, "loopedbfs": pipelining.ScheduleLoopedBFS,
    "interleavedzb": pipelining.ScheduleInterleavedZeroBubble, "zbv": pipelining.ScheduleZBVZeroBubble,
    "dualpipev": pipelining.ScheduleDualPipeV,
}


def _schedule(cfg: RunConfig, stages: list[PipelineStage], loss_fn: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``cfg.schedule`` over this rank's stages; a multi-stage one must place stages where ``cfg`` does."""
    if cfg.schedule == "gpipe":
        return ScheduleGPipe(stages[0], cfg.micro_batches, loss_fn=loss_fn)
    if cfg.schedule == "1f1b":
        return Schedule1F1B(stages[0], cfg.micro_batches, loss_fn=loss_fn)
    if cfg.schedule == "pipedream":
        return SchedulePipeDream(stages[0], cfg.micro_batches, loss_fn, optimizer, vertical_sync=cfg.vertical_sync)
    cls = multi_stage_class(cfg.schedule)
    name = cls.__name__
    schedule = cls(stages, cfg.micro_batches, loss_fn=loss_fn)
    placed = [int(schedule.stage_index_to_group_rank[v]) for v in range(cfg.virtual_stages)]
    if placed != [cfg.stage_rank(v) for v in range(cfg.virtual_stages)]:  # a torch that lays stages out otherwise
        raise RuntimeError(f"torch {torch.__version__}'s {name} runs stages on ranks {placed}; the reference "
                           f"trainer built them for ranks {[cfg.stage_rank(v) for v in range(cfg.virtual_stages)]}")
    return schedule


def _sub_spec(spec: Any, layer_ids: list[int]) -> Any:
    return replace(spec, layers=[spec.layers[i] for i in layer_ids])


@dataclass
class RunResult:
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)  # mean loss per step (last stage only)
    step_s: list[float] = field(default_factory=list)  # wall time of each step on this rank
    boundary_s: list[float] = field(default_factory=list)  # vpipe: of which applying plans before the step
    memory: dict[str, Any] | None = None  # vpipe: Vpipe.memory_report() at the end


def train_rank(cfg: RunConfig, ctx: Distributed) -> RunResult:
    """Train ``cfg.steps`` steps as rank ``ctx.rank`` (its stage, or its virtual stages); save results to
    ``cfg.out_dir`` if set."""
    if ctx.world_size != cfg.stages:
        raise ValueError(f"the run has {ctx.world_size} ranks but the config asks for {cfg.stages} "
                         f"{'ranks' if cfg.multi_stage else 'stages'}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
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
    log.info("rank %d of %d: stages %s of %d, training layers %s with %s", ctx.rank, cfg.stages, run.stage_indices,
             cfg.virtual_stages, run.layer_ids, cfg.schedule)
    vp = _attach_vpipe(cfg, run, resumed.vpipe if resumed is not None else None) if cfg.vpipe else None
    session = _control_session(cfg, run, ctx) if vp is None else None
    result = RunResult(steps=0, seconds=0.0)
    progress = _Progress(cfg, enabled=cfg.progress and run.is_last)
    now = {"step": first_step}
    faults.install_kill(run.modules[0], ctx.rank, lambda: now["step"])  # only when VPIPE_FAULTS asks for it
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
                result.losses.append(float(torch.stack([l.detach() for l in losses]).mean()))
            progress.update(step, result, time.perf_counter() - start)
            if cfg.checkpoint_dir and (step + 1 == cfg.steps or (cfg.checkpoint_every
                                                                 and (step + 1) % cfg.checkpoint_every == 0)):
                save_run_checkpoint(cfg, run, ctx, vp, steps_done=step + 1,
                                    placement=placement or cfg.stage_layer_ids())
        if isinstance(run.schedule, SchedulePipeDream):
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


def load_resume(cfg: RunConfig, verify: str = "stat") -> Any:
    """The verified checkpoint ``cfg.resume`` names, checked against ``cfg`` (CheckpointError otherwise).

    None when the directory holds no checkpoint at all yet: the first run of a job that is
    always launched with ``--resume`` (torchrun's restart pattern) starts from step 0.
    ``verify`` is :func:`~vpipe.checkpoint.load_checkpoint`'s: the launcher checks every shard,
    a rank hashes the shards it loads.
    """
    if not holds_checkpoints(cfg.resume or ""):
        return None
    ckpt = load_checkpoint(cfg.resume or "", verify=verify)
    newer = skipped_newer(cfg.resume or "")
    if newer is not None and verify == "all":  # the launcher says it once; ranks log it
        print(f"vpipe: {newer} has no manifest.json (unfinished or damaged); resuming from {ckpt.path.name}",
              file=sys.stderr)
    if ckpt.layer_order != list(range(cfg.n_layers)):
        raise CheckpointError(f"checkpoint {ckpt.path} holds layers {ckpt.layer_order[:3]}...{ckpt.layer_order[-1:]} "
                              f"in that order; this run's model has layers 0..{cfg.n_layers - 1}")
    if ckpt.step > cfg.steps:
        raise CheckpointError(f"checkpoint {ckpt.path} is after step {ckpt.step}, beyond --steps {cfg.steps}")
    saved = ckpt.extra.get("run_config")
    if isinstance(saved, dict):  # the model and optimizer must be the ones that were saved
        for name in ("model", "blocks", "d_model", "n_heads", "seq_len", "block_types", "optimizer"):
            if name in saved and saved[name] != getattr(cfg, name):
                raise CheckpointError(f"checkpoint {ckpt.path} was saved with {name} {saved[name]!r}; this run has "
                                      f"{getattr(cfg, name)!r}")
    return ckpt


def check_checkpoint_dir(cfg: RunConfig) -> None:
    """--checkpoint-dir must be writable: found at launch, not at the first checkpoint hours later."""
    if not cfg.checkpoint_dir:
        return
    root = Path(cfg.checkpoint_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".vpipe-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"--checkpoint-dir {root} is not writable: {e.strerror}") from None


def resume_placement(cfg: RunConfig, ckpt: Any) -> list[list[int]]:
    """Where the layers go on resume: ``cfg.partition`` if given, the checkpoint's placement on the
    same number of (virtual) stages, else an even split (the planner rebalances from there)."""
    if cfg.partition is None and ckpt.num_stages == cfg.virtual_stages:
        return ckpt.placement
    return cfg.stage_layer_ids()


def save_run_checkpoint(cfg: RunConfig, run: StageRun, ctx: Distributed, vp: Any, steps_done: int,
                        placement: list[list[int]]) -> None:
    """Collective: this rank's shard of the checkpoint after ``steps_done`` steps (rank 0 seals it).

    ``placement`` is the run's fixed placement when vpipe is off (vpipe knows its own)."""
    if vp is not None:
        state = vp.state_dict()
    else:
        state = {"version": VERSION, "epoch": 0, "iteration": steps_done, "stages": placement, "policies": {},
                 "next_layer_id": cfg.n_layers}
    state["iteration"] = steps_done
    save_checkpoint(cfg.checkpoint_dir or ".", steps_done, module=run.layers_view(), optimizer=run.optimizer,
                    rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, vpipe_state=state,
                    extra={"run_config": cfg.to_dict()}, scheduler=run.scheduler)


def _attach_vpipe(cfg: RunConfig, run: StageRun, resume_state: dict[str, Any] | None = None,
                  **overrides: Any) -> Any:
    """vpipe on this rank of the reference trainer, with the forced moves of ``cfg.moves`` requested.

    On resume the vpipe state is restored first, and only moves still ahead are requested,
    with epochs after the restored one. ``overrides`` set further :class:`VpipeConfig` fields."""
    spec = cfg.model_spec()
    config = VpipeConfig(
        memory_budget=cfg.memory_budget,
        planning=cfg.planning and cfg.planner is not None,
        planner=cfg.planner or "vpipe.planner.online:srp",
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
            specs = [block_spec(t, cfg.d_model, cfg.n_heads, 4 * cfg.d_model, cfg.dropout) for t in add["types"]]
            vp.add_layers(add["position"], specs)
        else:
            vp.remove_layers(event["remove"])


def _control_session(cfg: RunConfig, run: StageRun, ctx: Distributed) -> Any:
    """The monitor + control plane session of this rank, when ``cfg.monitor_every`` asks for one."""
    if not cfg.monitor_every:
        return None
    options = ControlOptions(sample_every=cfg.monitor_every, planner=cfg.planner, log_file=cfg.log_file)
    return open_for_stage_run(run, ctx, options)


def save_rank_result(cfg: RunConfig, run: StageRun, result: RunResult) -> None:
    out = Path(cfg.out_dir or ".")
    out.mkdir(parents=True, exist_ok=True)

    layers = run.layers_view()
    state = {
        "params": {k: v.detach().cpu() for k, v in layers.state_dict().items()},
        "optimizer": optimizer_state_by_name(dict(layers.named_parameters()), [run.optimizer]),
    }
    torch.save(state, out / f"rank{run.rank}.pt")
    # after migrations, not the initial ones: all of the rank's layers, and each of its stages' layers
    per_stage = [[int(name) for name in module._modules] for module in run.modules]
    meta = {"stage": run.stage_index, "layer_ids": [lid for ids in per_stage for lid in ids],
            "stages": run.stage_indices, "stage_layer_ids": per_stage, "losses": result.losses,
            "steps": result.steps, "seconds": result.seconds, "step_s": result.step_s,
            "boundary_s": result.boundary_s, "memory": result.memory,
            "lrs": [group["lr"] for group in run.optimizer.param_groups]}
    if isinstance(run.schedule, SchedulePipeDream):
        meta["trace"] = [list(event) for event in run.schedule.trace]
    (out / f"rank{run.rank}.json").write_text(json.dumps(meta))


def samples_per_s(cfg: RunConfig, result: RunResult) -> float:
    return 0.0 if result.seconds <= 0 else result.steps * cfg.batch_size / result.seconds


def print_summary(cfg: RunConfig, result: RunResult) -> None:
    table = Table(title="vpipe run summary", show_header=False)
    table.add_row("model", f"{cfg.model_spec().name} ({cfg.n_layers} layers)")
    stages = f"{cfg.virtual_stages} stages on {cfg.stages} ranks" if cfg.multi_stage else f"{cfg.stages} stages"
    table.add_row("pipeline", f"{stages}, {cfg.schedule}, layers per stage {cfg.layer_counts()}")
    table.add_row("batch", f"{cfg.micro_batches} micro-batches x {cfg.micro_batch_size}")
    table.add_row("steps", f"{result.steps} in {result.seconds:.1f} s")
    table.add_row("throughput", f"{samples_per_s(cfg, result):.1f} samples/s")
    if result.losses:
        table.add_row("loss", f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    Console(stderr=False).print(table)


class _Progress:
    """A rich progress bar with loss and samples/s, shown by one rank only."""

    def __init__(self, cfg: RunConfig, enabled: bool) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                TimeRemainingColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.cfg.steps, loss="-", rate="-")
        return self

    def update(self, step: int, result: RunResult, elapsed: float) -> None:
        if self._bar is None:
            return
        loss = f"{result.losses[-1]:.3f}" if result.losses else "-"
        rate = f"{(step + 1) * self.cfg.batch_size / max(elapsed, 1e-9):.1f}"
        self._bar.update(self._task, completed=step + 1, loss=loss, rate=rate)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
