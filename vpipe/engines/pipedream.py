"""vpipe's own ``SchedulePipeDream``: asynchronous 1F1B with weight stashing, a stream that never flushes."""

from __future__ import annotations

from typing import Any

import torch

from vpipe.engines.base import Engine, EngineKind
from vpipe.engines.torch_single import TorchSingleEngine, read_single_stage
from vpipe.schedules.pipedream import SchedulePipeDream

__all__ = ["PipeDreamEngine"]


class PipeDreamEngine(TorchSingleEngine):
    """A stream: micro-batches stay in flight across steps, moves are streamed into it one hop per step, each
    stage stashes a version of its weights per micro-batch in flight."""

    kind = EngineKind.PIPEDREAM
    streams = True
    carry_refusal = "is not supported under SchedulePipeDream (its streamed moves do not carry averages)"
    replica_refusal = ("a PipeDream stream with data-parallel replicas is not supported; run "
                       "one pipeline over the whole world, or use GPipe / 1F1B / the multi-stage schedules")

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return isinstance(target, SchedulePipeDream)

    @classmethod
    def read(cls, target: Any) -> Engine:
        return cls(read_single_stage(target, "pipedream"))

    def default_optimizer(self) -> torch.optim.Optimizer | None:
        optimizer: torch.optim.Optimizer | None = self.pipeline.schedule.optimizer
        return optimizer

    def weight_versions(self, stage: int) -> int:
        n = self.pipeline.num_stages
        return n if self.pipeline.schedule.vertical_sync else n - stage

    def own_copies(self) -> list[object]:
        return list(self.pipeline.schedule.stashed_versions())

    def move_refusal(self) -> str | None:
        blocks = self.pipeline.first.blocks
        if blocks is not None and (blocks.path or blocks.style.value != "ids"):
            return ("a PipeDream stream moves layers only in a stage module that is an "
                    "nn.Sequential named by global layer id")
        return None

    def unsettled(self) -> str | None:
        in_flight = self.pipeline.schedule.in_flight
        if in_flight:
            n = len(in_flight)
            return (f"a PipeDream stream needs schedule.flush() first "
                    f"({n} micro-batch{'es' if n > 1 else ''} in flight)")
        return None
