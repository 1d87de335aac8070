"""DeepSpeed's ``PipelineEngine``: one stage per rank of its pipe group, stepped by ``train_batch``.

Its layers are read and kept in step by :class:`~vpipe.stage.deepspeed.DeepSpeedStage`;
this adapter says what else differs: DeepSpeed counts the micro-batches of a step itself,
resets its own cached shapes and p2p buffers, may recompute the layers itself, refuses
edits, and writes its checkpoints on the partition it built ("home").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from vpipe.compat.deepspeed import is_pipeline_engine, is_pipeline_module
from vpipe.engines.base import Engine, EngineKind, Placement
from vpipe.stage.blocks import BlockContainerError
from vpipe.stage.deepspeed import DeepSpeedStage
from vpipe.stage.pipeline import LocalStage, Pipeline, check_tensor_parallel

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(Engine):
    """DeepSpeed's 1F1B ``TrainSchedule`` on a ``PipelineModule``: every step flushes."""

    kind = EngineKind.DEEPSPEED
    carry_refusal = "is not supported with DeepSpeed's PipelineEngine"
    step_method = "train_batch"
    counts_forwards = True  # its micro-batches are the stage module's forwards: no torch actions number them

    def __init__(self, pipeline: Pipeline, stage: DeepSpeedStage) -> None:
        super().__init__(pipeline)
        self.stage = stage

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return is_pipeline_engine(target) or is_pipeline_module(target)

    @classmethod
    def read(cls, target: Any) -> Engine:
        if not is_pipeline_engine(target):
            raise TypeError("vpipe.attach takes DeepSpeed's engine, not its PipelineModule: engine, *_ = "
                            "deepspeed.initialize(model=module, ...); vpipe.attach(engine)")
        stage = DeepSpeedStage(target)
        group = target.grid.get_pipe_parallel_group()
        if dist.get_rank(group) != stage.index:
            raise ValueError(f"vpipe.attach: DeepSpeed stage {stage.index} is rank {dist.get_rank(group)} of "
                             "its pipe group; vpipe needs stage i on group rank i (DeepSpeed's own "
                             "topologies do that)")
        empty = stage.empty_stages()
        if empty:
            raise BlockContainerError(f"vpipe.attach: DeepSpeed stage(s) {empty} hold none of the model's "
                                      f"repeated blocks (layers {stage.run.start}..{stage.run.stop - 1}); "
                                      "vpipe needs one per stage: use partition_method='uniform' or "
                                      "'type:BlockClass'")
        p = next(stage.module.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        local = [LocalStage(stage.index, stage.module, container=stage.container)]
        pipeline = Pipeline(target, local, stage.num_stages, tuple(range(stage.num_stages)), "1f1b", device,
                            group,
                            int(target.micro_batches))
        return cls(check_tensor_parallel(pipeline), stage)

    def default_optimizer(self) -> torch.optim.Optimizer | None:
        return self.stage.torch_optimizer()  # the torch optimizer DeepSpeed steps (fp32)

    def reset_shapes(self) -> None:
        self.stage.engine.reset_activation_shape()  # its cached shapes and p2p buffers

    def move_refusal(self) -> str | None:
        return self.stage.move_refusal()

    def edit_refusal(self) -> str | None:
        return ("a DeepSpeed PipelineModule: its layer specs and checkpoint files are "
                "numbered by layer index at initialize; vpipe only moves its layers")

    def recomputes_itself(self) -> str | None:
        if not self.stage.checkpoints_itself:
            return None
        return (f"DeepSpeed recomputes the layers itself "
                f"(activation_checkpoint_interval={self.stage.module.activation_checkpoint_interval})")

    def fixed_layers(self) -> Mapping[int, str]:
        return dict.fromkeys(self.stage.tied_layers(),
                             "is a DeepSpeed TiedLayerSpec, shared with another stage")

    def followers(self) -> list[Any]:
        return [self.stage]  # the engine's names of the parameters, and the module written back at each plan

    @property
    def checkpoint_home(self) -> Placement | None:
        return self.stage.home
