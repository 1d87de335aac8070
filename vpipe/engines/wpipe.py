"""vpipe's own ``ScheduleWPipe``: two stages a rank (groups G0 and
G1), G0's micro-batches in flight across steps."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vpipe.compat.torch_distributed import schedule_stages
from vpipe.engines.base import Engine, EngineKind, Placement
from vpipe.schedules.wpipe import ScheduleWPipe
from vpipe.stage.pipeline import (
    LocalStage,
    Pipeline,
    check_schedule_api,
    check_tensor_parallel,
    pipeline_group,
    unwrap_stage_module,
)

__all__ = ["WPipeEngine"]


class WPipeEngine(Engine):
    """A stream (G0's period stays in flight from one step to the next) over two virtual stages a rank, stage
    ``v`` on rank ``v mod W`` as torch's looped schedules place them. G0 holds two weight versions, G1 one.
    Blocks move between neighbouring stages of one group: G0's streamed as under 2BW (switching at a period's
    start, taking both versions and the optimizer state), G1's at a step boundary (its period ends within the
    step); the boundary between the groups stays where it is (docs/schedules.md, "WPipe")."""

    kind = EngineKind.WPIPE
    streams = True
    carry_refusal = "is not supported under ScheduleWPipe (its streamed moves do not carry averages)"
    replica_refusal = ("a WPipe stream with data-parallel replicas is not supported; run one "
                       "pipeline over the whole world, or use GPipe / 1F1B / the multi-stage schedules")

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return isinstance(target, ScheduleWPipe)

    @classmethod
    def read(cls, target: Any) -> Engine:
        check_schedule_api(target)
        stages = schedule_stages(target)
        group = pipeline_group(stages[0])
        ranks = dist.get_world_size(group)
        order = tuple(v % ranks for v in range(2 * ranks))
        local = [LocalStage(s.stage_index, unwrap_stage_module(s.submod), s) for s in stages]
        return cls(check_tensor_parallel(Pipeline(target, local, 2 * ranks, order, "wpipe",
                                                  torch.device(stages[0].device), group,
                                                  target.micro_batches)))

    def default_optimizer(self) -> torch.optim.Optimizer | None:
        optimizer: torch.optim.Optimizer | None = self.pipeline.schedule.optimizer
        return optimizer

    def weight_versions(self, stage: int) -> int:
        return 2 if stage < self.pipeline.num_stages // 2 else 1

    def own_copies(self) -> list[object]:
        return list(self.pipeline.schedule.stashed_versions())

    def move_refusal(self) -> str | None:
        for stage in self.pipeline.stages:
            if stage.blocks is not None and (stage.blocks.path or stage.blocks.style.value != "ids"):
                return ("a WPipe stream moves layers only in stage modules that are nn.Sequential named by "
                        "global layer id")
        return None

    def plan_refusal(self, start: Placement, stages: Placement) -> str | None:
        half = self.pipeline.num_stages // 2
        crossing = sorted(set().union(*start[:half]).symmetric_difference(set().union(*stages[:half])))
        if crossing:
            return (f"under ScheduleWPipe layers {crossing} would cross the boundary between G0 and G1 "
                    f"(stages {half - 1} and {half}), which stays fixed")
        return None

    def edit_refusal(self) -> str | None:
        return "a ScheduleWPipe stream"

    def unsettled(self) -> str | None:
        in_flight = self.pipeline.schedule.in_flight
        if in_flight:
            return f"a WPipe stream needs schedule.flush() first (period {in_flight[0]} in flight on G0)"
        return None
