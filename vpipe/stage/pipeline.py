"""A pipeline as vpipe reads it, whatever the engine: this rank's
stages, every stage's rank, its process group.

Each engine's adapter (:mod:`vpipe.engines`) reads what the trainer passed to ``attach``
into a :class:`Pipeline`: the local stages (torch's stage object, the user's module), the
rank of every stage, the schedule's name for the cost model, the micro-batches of a step
and, for multi-stage schedules, how many micro-batches each stage holds at its peak (read
off the schedule's own action lists, so plans are made for the schedule that runs). The
pipeline's process group is the stage's (``PipelineStage(..., group=pp_group)``): one
dimension of a mesh, or the world; ranks here count in that group. What holds for every
engine lives here: the stage modules vpipe refuses (DDP, FSDP1, tensor parallelism across
the pipeline), the optimizer check, and the stages' own reasons layers cannot move or be
edited. Nothing is replaced: ``stage.submod`` and its ``forward`` stay the user's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from vpipe.compat.torch_distributed import (
    composable_apis,
    is_fsdp1,
    missing_schedule_internals,
    missing_stage_state,
    reset_stage_shapes,
    schedule_stages,
)
from vpipe.sharing import action_kind, flat_actions, in_flight_per_stage, in_flight_together
from vpipe.stage.blocks import StageBlocks
from vpipe.stage.fsdp import fsdp_refusal, is_fully_sharded
from vpipe.stage.quiet_inference import owe_quiet_inference
from vpipe.stage.tensor_parallel import spanning_pipeline, tensor_parallel_move_refusal, tensor_parallel_names

log = logging.getLogger("vpipe.attach")

__all__ = ["AttachTarget", "LocalStage", "Pipeline", "reset_shape_inference", "check_schedule_api",
           "check_optimizer", "check_tensor_parallel", "unwrap_stage_module", "pipeline_group",
           "stage_move_refusal", "stage_edit_refusal", "in_flight_per_stage", "in_flight_together",
           "flat_actions",
           "action_kind"]

# what attach takes: a single-stage schedule (SchedulePipeDream is one), a multi-stage one, or a stage module
AttachTarget: TypeAlias = PipelineScheduleSingle | PipelineScheduleMulti | nn.Module


@dataclass
class LocalStage:
    """One stage this rank runs: its index in model order, torch's stage object, the user's module."""

    index: int
    module: nn.Module
    pipeline_stage: Any = None  # torch's PipelineStage; None for a hand-written loop
    blocks: StageBlocks | None = None  # its run of repeated blocks, once the stages agreed on layer ids
    # where its blocks are when the adapter found them (DeepSpeed), else None
    container: nn.Module | None = None


@dataclass
class Pipeline:
    """What vpipe learned about the pipeline from the target."""

    schedule: Any  # None for a hand-written loop
    stages: list[LocalStage]
    num_stages: int
    stage_ranks: tuple[int, ...]  # the rank of every stage, in the pipeline's own process group
    kind: str  # the cost model's schedule name: gpipe, 1f1b, pipedream, interleaved1f1b, ..., custom
    device: torch.device
    group: Any = None  # the pipeline's process group (None: the world)
    # the micro-batches the engine runs per step; None: a hand-written loop
    step_micro_batches: int | None = None

    @property
    def rank(self) -> int:
        """This rank in the pipeline's group (stage indices and ``stage_ranks`` count in it)."""
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def global_ranks(self) -> tuple[int, ...]:
        """The world rank of every rank of the pipeline's group, in group order."""
        if self.group is None:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_global_rank(self.group, r) for r in range(self.size))

    @property
    def multi_stage(self) -> bool:
        return len(self.stage_ranks) != len(set(self.stage_ranks))

    @property
    def first(self) -> LocalStage:
        return self.stages[0]

    def micro_batches(self, configured: int | None) -> int:
        """The micro-batches of a step: the engine's count, else
        what the trainer configured (a hand-written loop)."""
        return self.step_micro_batches or configured or 1

    def in_flight(self) -> list[int] | None:
        """Per stage, the micro-batches it holds activations of at
        its peak (multi-stage schedules), else None."""
        if not self.multi_stage:
            return None
        return in_flight_per_stage(self.schedule.pipeline_order, self.num_stages)

    def in_flight_together(self) -> list[list[int]] | None:
        """The micro-batches every stage holds at each forward (multi-stage schedules), else None."""
        if not self.multi_stage:
            return None
        return in_flight_together(self.schedule.pipeline_order, self.num_stages)


def unwrap_stage_module(module: nn.Module) -> nn.Module:
    """The stage module to find blocks in: refuse wrappers and parallelisms vpipe cannot move blocks of
    (FSDP2's ``fully_shard`` and tensor parallelism are accepted: the module stays the module)."""
    wrapped = type(module).__name__
    if wrapped == "DistributedDataParallel" or _composable(module, "replicate"):
        how = wrapped if wrapped == "DistributedDataParallel" else "replicate()"
        raise TypeError(f"vpipe.attach does not support a stage module wrapped in {how}: its gradient "
                        "buckets are fixed at wrap time and would go stale when blocks move. Keep the stage "
                        "module unwrapped and all-reduce its gradients over the data-parallel group after "
                        "schedule.step() yourself (vpipe keeps the replicas' blocks alike)")
    if any(is_fsdp1(m) for m in module.modules()):
        raise TypeError("vpipe.attach does not support FSDP1 (FullyShardedDataParallel) on a "
                        "stage module: its flat parameters hold every block at once. Use FSDP2, torchtitan's "
                        "way: fully_shard(block, "
                        "mesh=dp_mesh) on every block, then fully_shard(stage_module, mesh=dp_mesh)")
    return module


def check_tensor_parallel(pipeline: Pipeline) -> Pipeline:
    """Tensor parallelism is welcome on a mesh dimension of its own; sharding across stages is not."""
    ranks, me = pipeline.global_ranks(), dist.get_rank()
    for stage in pipeline.stages:
        spanning = spanning_pipeline(stage.module, ranks, me)
        if spanning:
            raise TypeError(f"vpipe.attach: stage {stage.index}'s DTensor parameter(s) "
                            f"{', '.join(spanning[:3])} are placed on a mesh that holds other ranks of this "
                            f"pipeline (world ranks {list(ranks)}); a stage holds its blocks whole or shards "
                            "them over other mesh dimensions (FSDP2 over dp, tensor parallelism over tp), "
                            "never over the pipeline's own")
    return pipeline


def _composable(module: nn.Module, name: str) -> bool:
    """Whether torch's composable API ``name`` (``replicate``, ``fully_shard``) was applied to ``module``."""
    if name == "fully_shard" and any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
        return True
    return name in composable_apis(module)


def pipeline_group(stage: Any) -> Any:
    """The pipeline's process group (None: the world). Stage indices are ranks in it."""
    return getattr(stage, "group", None)


def check_optimizer(optimizer: torch.optim.Optimizer | None, modules: Sequence[nn.Module]) -> None:
    """An optimizer that updates none of the stages' parameters would leave the model untrained, silently."""
    if optimizer is None:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        mine = {id(p) for p in module.parameters()}
        if mine and not mine & held:
            raise ValueError(f"vpipe.attach: the optimizer holds none of this stage's {len(mine)} "
                             "parameters; pass the optimizer built over this rank's stage modules (e.g. "
                             "torch.optim.AdamW(params of every stage this rank runs))")
    staged = {id(p) for module in modules for p in module.parameters()}
    foreign = {g: sum(id(p) not in staged for p in group["params"])
               for g, group in enumerate(optimizer.param_groups)}
    foreign = {g: n for g, n in foreign.items() if n}
    if foreign:  # e.g. an optimizer built over the whole model before it was split
        log.warning("vpipe.attach: optimizer param group(s) %s hold %d parameter(s) that "
                    "are not in this rank's "
                    "stage modules; moves carry only the stages' parameters and their optimizer state, so "
                    "those stay in this rank's optimizer", sorted(foreign), sum(foreign.values()))


def check_schedule_api(schedule: Any) -> None:
    """Fail early (at attach) if this torch's pipelining internals differ from what vpipe edits."""
    missing = missing_schedule_internals(schedule)
    for stage in schedule_stages(schedule):
        missing += missing_stage_state(stage)
    if missing:
        raise RuntimeError(
            f"vpipe cannot attach to {type(schedule).__name__} with torch "
            f"{torch.__version__}: its pipelining API "
            f"lacks {', '.join(sorted(set(missing)))} (vpipe is tested with torch 2.11 and 2.13)"
        )


def reset_shape_inference(schedule: Any) -> None:
    """Make the schedule's next ``step()`` redo P2P warm-up and metadata inference on every stage.

    torch's stages size their receive buffers from a metadata pass that runs on the first
    ``step()`` and chains through every stage. When a move changes the shape, dtype or
    arity of a boundary activation, every rank must redo that pass at the same step (a
    rebuild on two ranks only would hang the chain). The pass redone runs quiet (:mod:`.quiet_inference`).
    """
    check_schedule_api(schedule)
    reset_stage_shapes(schedule)
    for stage in schedule_stages(schedule):
        owe_quiet_inference(stage)


def stage_edit_refusal(pipeline: Pipeline) -> str | None:
    """Why this rank's stages, whatever the engine, cannot have
    layers added or removed (a noun phrase), or None."""
    if any(isinstance(s.module, torch.fx.GraphModule) for s in pipeline.stages):
        return "a traced GraphModule stage (its forward is a fixed graph)"
    return None


def stage_move_refusal(pipeline: Pipeline, has_factory: bool) -> str | None:
    """Why this rank's layers, whatever the engine, cannot move, or
    None (the engine may add a reason of its own)."""
    if any(isinstance(s.module, torch.fx.GraphModule) for s in pipeline.stages):
        return "the stage is a traced GraphModule (pipeline() split): its forward is a fixed graph of modules"
    for stage in pipeline.stages:
        assert stage.blocks is not None  # agree_on_blocks set every local stage's blocks
        blocks = stage.blocks.blocks().values()
        tp = tensor_parallel_move_refusal(blocks)
        if tp is None and has_factory and any(tensor_parallel_names(b) for b in blocks):
            tp = "tensor parallelism: blocks built by layer_factory= would not be parallelised; leave it out"
        if tp is not None:
            return tp
        fsdp = fsdp_refusal(stage.module, blocks)
        if fsdp is None and has_factory and is_fully_sharded(stage.module):
            fsdp = ("FSDP: blocks built by layer_factory= would not be sharded; leave it "
                    "out (blocks are cloned)")
        if fsdp is not None:
            return fsdp
    return None
