"""One rank of the reference trainer, built: its stages' chunks of the model, the schedule, one optimizer.

:func:`build_stage_run` places the layers a placement gives each stage this rank runs (one,
or several virtual stages under a multi-stage schedule; :mod:`vpipe_lab.runtime.layout`) and
returns the :class:`StageRun` that :mod:`vpipe_lab.runtime.trainer` trains, checkpoints and
attaches vpipe to.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from vpipe.compat.torch_internals import child_modules
from vpipe.schedules.pipedream import SchedulePipeDream
from vpipe.schedules.pipedream_2bw import SchedulePipeDream2BW
from vpipe.schedules.wpipe import ScheduleWPipe
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.models import build_model
from vpipe_lab.runtime.optim import make_optimizer, make_scheduler

__all__ = ["StageRun", "build_stage_run", "multi_stage_class", "sub_spec"]


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
    def streams(self) -> bool:
        """Whether the schedule is one of vpipe's streams (PipeDream, 2BW, WPipe): it steps the optimizer
        itself, keeps micro-batches in flight across steps and needs ``flush()`` at the end."""
        return isinstance(self.schedule, (SchedulePipeDream, ScheduleWPipe))

    @property
    def stage_index(self) -> int:
        """The first stage this rank runs (its only one under a single-stage schedule)."""
        return self.stage_indices[0]

    @property
    def module(self) -> nn.Sequential:
        """This rank's only chunk; under a multi-stage schedule use :attr:`modules` or :meth:`layers_view`."""
        if len(self.modules) != 1:
            raise ValueError(f"rank {self.rank} runs stages {self.stage_indices}: use "
                             "modules[i] or layers_view()")
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
        return [int(name) for module in self.modules for name in child_modules(module)]

    def layers_view(self) -> nn.Sequential:
        """Every layer of this rank in one ``Sequential`` named by global layer id: the chunks' own modules,
        not copies, so checkpoints and results save and load them by the same names on any layout."""
        if len(self.modules) == 1:
            return self.modules[0]
        return nn.Sequential(OrderedDict((name, layer) for module in self.modules
                                         for name, layer in module.named_children()))

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
        if not self.streams:
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
    modules = [build_model(sub_spec(spec, placement[v]), seed=cfg.seed, ids=list(placement[v])).to(device)
               for v in indices]
    stages = [PipelineStage(module, v, cfg.virtual_stages, device, group=group)
              for module, v in zip(modules, indices)]
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


def _schedule(cfg: RunConfig, stages: list[PipelineStage], loss_fn: Any,
              optimizer: torch.optim.Optimizer) -> Any:
    """``cfg.schedule`` over this rank's stages; a multi-stage one must place stages where ``cfg`` does."""
    if cfg.schedule == "gpipe":
        return ScheduleGPipe(stages[0], cfg.micro_batches, loss_fn=loss_fn)
    if cfg.schedule == "1f1b":
        return Schedule1F1B(stages[0], cfg.micro_batches, loss_fn=loss_fn)
    if cfg.schedule == "pipedream":
        return SchedulePipeDream(stages[0], cfg.micro_batches, loss_fn, optimizer,
                                 vertical_sync=cfg.vertical_sync)
    if cfg.schedule == "pipedream2bw":
        return SchedulePipeDream2BW(stages[0], cfg.micro_batches, loss_fn, optimizer)
    if cfg.schedule == "wpipe":  # G0's stage r and G1's W + r, as the looped layout places them
        return ScheduleWPipe(stages, cfg.micro_batches, loss_fn, optimizer)
    cls = multi_stage_class(cfg.schedule)
    name = cls.__name__
    schedule = cls(stages, cfg.micro_batches, loss_fn=loss_fn)
    placed = [int(schedule.stage_index_to_group_rank[v]) for v in range(cfg.virtual_stages)]
    # a torch that lays stages out otherwise
    if placed != [cfg.stage_rank(v) for v in range(cfg.virtual_stages)]:
        raise RuntimeError(f"torch {torch.__version__}'s {name} runs stages on ranks {placed}; the reference "
                           "trainer built them for ranks "
                           f"{[cfg.stage_rank(v) for v in range(cfg.virtual_stages)]}")
    return schedule


def sub_spec(spec: Any, layer_ids: list[int]) -> Any:
    return replace(spec, layers=[spec.layers[i] for i in layer_ids])
