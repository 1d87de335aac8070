"""A plain stage module in a hand-written loop: one stage, stage i
on rank i, the optimizer's step ends a step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vpipe.engines.base import Engine, EngineKind
from vpipe.stage.pipeline import LocalStage, Pipeline, check_tensor_parallel, unwrap_stage_module

__all__ = ["ModuleEngine"]


class ModuleEngine(Engine):
    """No schedule: the trainer runs the forwards and backwards, and says the micro-batches per step
    (``micro_batches=``); vpipe numbers them by the stage module's forwards."""

    kind = EngineKind.MODULE
    step_method = None
    counts_forwards = True

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return isinstance(target, nn.Module)

    @classmethod
    def read(cls, target: Any) -> Engine:
        module = unwrap_stage_module(target)
        p = next(module.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        rank, world = dist.get_rank(), dist.get_world_size()
        return cls(check_tensor_parallel(Pipeline(None, [LocalStage(rank, module)], world,
                                                  tuple(range(world)),
                                                  "gpipe", device)))
