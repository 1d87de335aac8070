"""torch's multi-stage schedules (those that run an action list): several *virtual*
stages per rank, the schedule knows which rank runs each."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from vpipe.compat.torch_distributed import PipelineScheduleRuntime, n_microbatches, schedule_stages
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

__all__ = ["TorchMultiEngine", "MULTI_STAGE_SCHEDULES"]

# torch's multi-stage schedules by class name -> the cost model's name for them
MULTI_STAGE_SCHEDULES = {
    "ScheduleInterleaved1F1B": "interleaved1f1b",
    "ScheduleLoopedBFS": "loopedbfs",
    "ScheduleInterleavedZeroBubble": "interleavedzb",
    "ScheduleZBVZeroBubble": "zbv",
    "ScheduleDualPipeV": "dualpipev",
}


class TorchMultiEngine(Engine):
    """Interleaved 1F1B, LoopedBFS, the zero-bubble schedules, or a ``_PipelineScheduleRuntime`` loaded
    from an action list: every step flushes, boundary shapes come from torch's shape inference."""

    kind = EngineKind.TORCH_MULTI

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return isinstance(target, PipelineScheduleMulti)

    @classmethod
    def read(cls, target: Any) -> Engine:
        if not isinstance(target, PipelineScheduleRuntime) or getattr(target, "pipeline_order", None) is None:
            raise TypeError(f"vpipe.attach supports the multi-stage schedules that run an action list "
                            f"({', '.join(MULTI_STAGE_SCHEDULES)}, or _PipelineScheduleRuntime "
                            f"with a loaded CSV); {type(target).__name__} has none")
        check_schedule_api(target)
        stages = sorted(schedule_stages(target), key=lambda s: s.stage_index)
        group = pipeline_group(stages[0])
        rank = dist.get_rank(group)
        mapping = target.stage_index_to_group_rank
        num_stages = stages[0].num_stages
        ranks = tuple(int(mapping[v]) for v in range(num_stages))
        mine = [v for v, r in enumerate(ranks) if r == rank]
        if [s.stage_index for s in stages] != mine:
            raise ValueError("vpipe.attach: this rank's schedule holds stages "
                             f"{[s.stage_index for s in stages]}, its "
                             f"action lists give rank {rank} stages {mine}")
        kind = MULTI_STAGE_SCHEDULES.get(type(target).__name__, "custom")
        local = [LocalStage(s.stage_index, unwrap_stage_module(s.submod), s) for s in stages]
        return cls(check_tensor_parallel(Pipeline(target, local, num_stages, ranks, kind,
                                                  torch.device(stages[0].device), group,
                                                  n_microbatches(target))))

    def reset_shapes(self) -> None:
        reset_shape_inference(self.pipeline.schedule)
