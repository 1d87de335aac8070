"""torch's single-stage schedules (``ScheduleGPipe``, ``Schedule1F1B``):
one stage per rank, stage i on rank i."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from vpipe.compat.torch_distributed import n_microbatches, single_stage
from vpipe.engines.base import Engine, EngineKind
from vpipe.stage.pipeline import (
    LocalStage,
    Pipeline,
    check_schedule_api,
    check_tensor_parallel,
    pipeline_group,
    reset_shape_inference,
    unwrap_stage_module,
)

__all__ = ["TorchSingleEngine", "read_single_stage"]


def read_single_stage(schedule: Any, kind: str) -> Pipeline:
    """The pipeline of a single-stage schedule; ``kind`` is the cost model's name for it."""
    check_schedule_api(schedule)
    stage = single_stage(schedule)
    group = pipeline_group(stage)
    rank = dist.get_rank(group)
    if stage.stage_index != rank:  # vpipe addresses a stage's peers by rank: never misroute a layer
        raise ValueError(f"vpipe.attach: stage {stage.stage_index} runs on rank {rank} of its pipeline's "
                         "process group; vpipe needs stage i on group rank i (as torch's single-stage "
                         "schedules do)")
    local = [LocalStage(stage.stage_index, unwrap_stage_module(stage.submod), stage)]
    return check_tensor_parallel(Pipeline(schedule, local, stage.num_stages, tuple(range(stage.num_stages)),
                                          kind,
                                          torch.device(stage.device), group, n_microbatches(schedule)))


class TorchSingleEngine(Engine):
    """GPipe or 1F1B: every step flushes, boundary shapes come from torch's shape inference."""

    kind = EngineKind.TORCH_SINGLE

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return isinstance(target, PipelineScheduleSingle)

    @classmethod
    def read(cls, target: Any) -> Engine:
        return cls(read_single_stage(target, "1f1b" if isinstance(target, Schedule1F1B) else "gpipe"))

    def reset_shapes(self) -> None:
        reset_shape_inference(self.pipeline.schedule)
