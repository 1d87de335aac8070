"""The stage adapter: what vpipe runs underneath, read from whatever the trainer passed to ``attach``.

A trainer hands vpipe one of:

- a single-stage ``torch.distributed.pipelining`` schedule (``ScheduleGPipe``,
  ``Schedule1F1B``) or vpipe's ``SchedulePipeDream``: this rank runs one stage, stage i on
  rank i;
- a multi-stage schedule (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, or a
  ``_PipelineScheduleRuntime`` loaded from an action list): this rank runs several
  *virtual* stages, the schedule knows which rank runs each;
- a plain stage module, for a hand-written loop: one stage, stage i on rank i;
- DeepSpeed's ``PipelineEngine``: one stage per rank of its pipe group, stepped by
  ``train_batch`` (:mod:`vpipe.stage.deepspeed` reads its layers).

:func:`inspect_target` turns each into a :class:`Pipeline`: the local stages (torch's stage
object, the user's module), the rank of every stage, the schedule's name for the cost
model and, for multi-stage schedules, how many micro-batches each stage holds at its peak
(read off the schedule's own action lists, so plans are made for the schedule that runs).
The pipeline's process group is the stage's (``PipelineStage(..., group=pp_group)``): one
dimension of a mesh, or the world; ranks here count in that group.
Nothing is replaced: ``stage.submod`` and its ``forward`` stay the user's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from vpipe.compat.deepspeed import is_pipeline_engine, is_pipeline_module
from vpipe.compat.torch_distributed import (
    PipelineScheduleRuntime,
    composable_apis,
    forget_inferred_meta,
    is_fsdp1,
    mark_stages_uninitialized,
    missing_schedule_internals,
    n_microbatches,
    schedule_stages,
    single_stage,
)
from vpipe.schedules.pipedream import SchedulePipeDream
from vpipe.sharing import action_kind, flat_actions, in_flight_per_stage, in_flight_together
from vpipe.stage.blocks import BlockContainerError, StageBlocks
from vpipe.stage.deepspeed import DeepSpeedStage
from vpipe.stage.fsdp import fsdp_refusal, is_fully_sharded
from vpipe.stage.tensor_parallel import spanning_pipeline, tensor_parallel_move_refusal, tensor_parallel_names

log = logging.getLogger("vpipe.attach")

__all__ = ["AttachTarget", "LocalStage", "Pipeline", "inspect_target", "reset_shape_inference", "check_schedule_api",
           "move_refusal", "in_flight_per_stage", "in_flight_together", "flat_actions", "action_kind",
           "MULTI_STAGE_SCHEDULES"]

# what attach takes: a single-stage schedule (SchedulePipeDream is one), a multi-stage one, or a stage module
AttachTarget: TypeAlias = PipelineScheduleSingle | PipelineScheduleMulti | nn.Module

# torch's multi-stage schedules by class name -> the cost model's name for them
MULTI_STAGE_SCHEDULES = {
    "ScheduleInterleaved1F1B": "interleaved1f1b",
    "ScheduleLoopedBFS": "loopedbfs",
    "ScheduleInterleavedZeroBubble": "interleavedzb",
    "ScheduleZBVZeroBubble": "zbv",
    "ScheduleDualPipeV": "dualpipev",
}
_STAGE_STATE = ("args_recv_info", "grad_recv_info", "act_send_info", "grad_send_info", "fwd_cache", "bwd_cache")


@dataclass
class LocalStage:
    """One stage this rank runs: its index in model order, torch's stage object, the user's module."""

    index: int
    module: nn.Module
    pipeline_stage: Any = None  # torch's PipelineStage; None for a hand-written loop
    blocks: StageBlocks | None = None  # its run of repeated blocks, once the stages agreed on layer ids
    container: nn.Module | None = None  # where its blocks are when the adapter found them (DeepSpeed), else None


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
    deepspeed: DeepSpeedStage | None = None  # the stage of a DeepSpeed engine (``schedule``), else None

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

    @property
    def step_method(self) -> str:
        """The schedule's method that runs one step: vpipe's step boundary is around it."""
        return "train_batch" if self.deepspeed is not None else "step"

    @property
    def counts_forwards(self) -> bool:
        """Whether the micro-batches are counted as the stage module's forwards (no pipelining actions number them)."""
        return self.schedule is None or self.deepspeed is not None

    def micro_batches(self, configured: int | None) -> int:
        if self.deepspeed is not None:
            return int(self.deepspeed.engine.micro_batches)
        if self.schedule is not None:
            return n_microbatches(self.schedule)
        return configured or 1

    def reset_shapes(self) -> None:
        """A move changed what a stage sends downstream: make the next step size the boundary activations anew
        (every rank at the same boundary: torch's shape inference, or a DeepSpeed engine's cached shapes and p2p
        buffers)."""
        if self.deepspeed is not None:
            self.deepspeed.engine.reset_activation_shape()
        elif self.schedule is not None:
            reset_shape_inference(self.schedule)

    def in_flight(self) -> list[int] | None:
        """Per stage, the micro-batches it holds activations of at its peak (multi-stage schedules), else None."""
        if not self.multi_stage:
            return None
        return in_flight_per_stage(self.schedule.pipeline_order, self.num_stages)

    def in_flight_together(self) -> list[list[int]] | None:
        """The micro-batches every stage holds at each forward (multi-stage schedules), else None."""
        if not self.multi_stage:
            return None
        return in_flight_together(self.schedule.pipeline_order, self.num_stages)


def inspect_target(target: AttachTarget) -> Pipeline:
    """The pipeline ``target`` (a schedule or a plain stage module) runs on this rank; refuses what vpipe cannot."""
    if isinstance(target, PipelineScheduleMulti):
        if not isinstance(target, PipelineScheduleRuntime) or getattr(target, "pipeline_order", None) is None:
            raise TypeError(f"vpipe.attach supports the multi-stage schedules that run an action list "
                            f"({', '.join(MULTI_STAGE_SCHEDULES)}, or _PipelineScheduleRuntime with a loaded CSV); "
                            f"{type(target).__name__} has none")
        check_schedule_api(target)
        stages = sorted(schedule_stages(target), key=lambda s: s.stage_index)
        group = _pipeline_group(stages[0])
        rank = dist.get_rank(group)
        mapping = target.stage_index_to_group_rank
        num_stages = stages[0].num_stages
        ranks = tuple(int(mapping[v]) for v in range(num_stages))
        mine = [v for v, r in enumerate(ranks) if r == rank]
        if [s.stage_index for s in stages] != mine:
            raise ValueError(f"vpipe.attach: this rank's schedule holds stages {[s.stage_index for s in stages]}, its "
                             f"action lists give rank {rank} stages {mine}")
        kind = MULTI_STAGE_SCHEDULES.get(type(target).__name__, "custom")
        local = [LocalStage(s.stage_index, _unwrap(s.submod), s) for s in stages]
        return _check_tensor_parallel(Pipeline(target, local, num_stages, ranks, kind, torch.device(stages[0].device),
                                               group))
    if isinstance(target, PipelineScheduleSingle):
        check_schedule_api(target)
        stage = single_stage(target)
        group = _pipeline_group(stage)
        rank = dist.get_rank(group)
        if stage.stage_index != rank:  # vpipe addresses a stage's peers by rank: never misroute a layer
            raise ValueError(f"vpipe.attach: stage {stage.stage_index} runs on rank {rank} of its pipeline's "
                             "process group; vpipe needs stage i on group rank i (as torch's single-stage "
                             "schedules do)")
        local = [LocalStage(stage.stage_index, _unwrap(stage.submod), stage)]
        return _check_tensor_parallel(Pipeline(target, local, stage.num_stages, tuple(range(stage.num_stages)),
                                               _single_kind(target), torch.device(stage.device), group))
    if is_pipeline_engine(target):
        return _check_tensor_parallel(_deepspeed_pipeline(target))
    if is_pipeline_module(target):
        raise TypeError("vpipe.attach takes DeepSpeed's engine, not its PipelineModule: engine, *_ = "
                        "deepspeed.initialize(model=module, ...); vpipe.attach(engine)")
    if isinstance(target, nn.Module):
        module = _unwrap(target)
        p = next(module.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        rank, world = dist.get_rank(), dist.get_world_size()
        return _check_tensor_parallel(Pipeline(None, [LocalStage(rank, module)], world, tuple(range(world)), "gpipe",
                                               device))
    raise TypeError("vpipe.attach takes a pipelining schedule, a DeepSpeed PipelineEngine or a stage module, got "
                    f"{type(target).__name__}")


def _deepspeed_pipeline(engine: Any) -> Pipeline:
    """A DeepSpeed engine's pipeline: stage i on rank i of its pipe group, DeepSpeed's 1F1B TrainSchedule."""
    stage = DeepSpeedStage(engine)
    group = engine.grid.get_pipe_parallel_group()
    if dist.get_rank(group) != stage.index:
        raise ValueError(f"vpipe.attach: DeepSpeed stage {stage.index} is rank {dist.get_rank(group)} of its pipe "
                         "group; vpipe needs stage i on group rank i (DeepSpeed's own topologies do that)")
    empty = stage.empty_stages()
    if empty:
        raise BlockContainerError(f"vpipe.attach: DeepSpeed stage(s) {empty} hold none of the model's repeated "
                                  f"blocks (layers {stage.run.start}..{stage.run.stop - 1}); vpipe needs one per "
                                  "stage: use partition_method='uniform' or 'type:BlockClass'")
    p = next(stage.module.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    local = [LocalStage(stage.index, stage.module, container=stage.container)]
    return Pipeline(engine, local, stage.num_stages, tuple(range(stage.num_stages)), "1f1b", device, group,
                    deepspeed=stage)


def _single_kind(schedule: Any) -> str:
    if isinstance(schedule, SchedulePipeDream):
        return "pipedream"
    return "1f1b" if isinstance(schedule, Schedule1F1B) else "gpipe"


def _unwrap(module: nn.Module) -> nn.Module:
    """The stage module to find blocks in: refuse wrappers and parallelisms vpipe cannot move blocks of
    (FSDP2's ``fully_shard`` and tensor parallelism are accepted: the module stays the module)."""
    wrapped = type(module).__name__
    if wrapped == "DistributedDataParallel" or _composable(module, "replicate"):
        how = wrapped if wrapped == "DistributedDataParallel" else "replicate()"
        raise TypeError(f"vpipe.attach does not support a stage module wrapped in {how}: its gradient buckets are "
                        "fixed at wrap time and would go stale when blocks move. Keep the stage module unwrapped and "
                        "all-reduce its gradients over the data-parallel group after schedule.step() yourself "
                        "(vpipe keeps the replicas' blocks alike)")
    if any(is_fsdp1(m) for m in module.modules()):
        raise TypeError("vpipe.attach does not support FSDP1 (FullyShardedDataParallel) on a stage module: its flat "
                        "parameters hold every block at once. Use FSDP2, torchtitan's way: fully_shard(block, "
                        "mesh=dp_mesh) on every block, then fully_shard(stage_module, mesh=dp_mesh)")
    return module


def _check_tensor_parallel(pipeline: Pipeline) -> Pipeline:
    """Tensor parallelism is welcome on a mesh dimension of its own; sharding across stages is not."""
    ranks, me = pipeline.global_ranks(), dist.get_rank()
    for stage in pipeline.stages:
        spanning = spanning_pipeline(stage.module, ranks, me)
        if spanning:
            raise TypeError(f"vpipe.attach: stage {stage.index}'s DTensor parameter(s) {', '.join(spanning[:3])} are "
                            f"placed on a mesh that holds other ranks of this pipeline (world ranks {list(ranks)}); "
                            "a stage holds its blocks whole or shards them over other mesh dimensions (FSDP2 over "
                            "dp, tensor parallelism over tp), never over the pipeline's own")
    return pipeline


def _composable(module: nn.Module, name: str) -> bool:
    """Whether torch's composable API ``name`` (``replicate``, ``fully_shard``) was applied to ``module``."""
    if name == "fully_shard" and any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
        return True
    return name in composable_apis(module)


def _pipeline_group(stage: Any) -> Any:
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
            raise ValueError(f"vpipe.attach: the optimizer holds none of this stage's {len(mine)} parameters; pass "
                             "the optimizer built over this rank's stage modules (e.g. torch.optim.AdamW(params of "
                             "every stage this rank runs))")
    staged = {id(p) for module in modules for p in module.parameters()}
    foreign = {g: sum(id(p) not in staged for p in group["params"]) for g, group in enumerate(optimizer.param_groups)}
    foreign = {g: n for g, n in foreign.items() if n}
    if foreign:  # e.g. an optimizer built over the whole model before it was split
        log.warning("vpipe.attach: optimizer param group(s) %s hold %d parameter(s) that are not in this rank's "
                    "stage modules; moves carry only the stages' parameters and their optimizer state, so "
                    "those stay in this rank's optimizer", sorted(foreign), sum(foreign.values()))


def check_schedule_api(schedule: Any) -> None:
    """Fail early (at attach) if this torch's pipelining internals differ from what vpipe edits."""
    missing = missing_schedule_internals(schedule)
    for stage in schedule_stages(schedule):
        missing += [f"stage.{a}" for a in _STAGE_STATE if not hasattr(stage, a)]
        missing += [f"stage.{m}" for m in ("forward_one_chunk", "backward_one_chunk", "submod")
                    if not hasattr(stage, m)]
    if missing:
        raise RuntimeError(
            f"vpipe cannot attach to {type(schedule).__name__} with torch {torch.__version__}: its pipelining API "
            f"lacks {', '.join(sorted(set(missing)))} (vpipe is tested with torch 2.11 and 2.13)"
        )


def reset_shape_inference(schedule: Any) -> None:
    """Make the schedule's next ``step()`` redo P2P warm-up and metadata inference on every stage.

    torch's stages size their receive buffers from a metadata pass that runs on the first
    ``step()`` and chains through every stage. When a move changes the shape, dtype or
    arity of a boundary activation, every rank must redo that pass at the same step (a
    rebuild on two ranks only would hang the chain).
    """
    check_schedule_api(schedule)
    mark_stages_uninitialized(schedule)
    for stage in schedule_stages(schedule):
        stage.args_recv_info.clear()
        stage.grad_recv_info.clear()
        stage.act_send_info.clear()
        stage.grad_send_info = None
        forget_inferred_meta(stage)  # torch <= 2.11 keeps the inferred shapes on the stage


def move_refusal(pipeline: Pipeline, has_factory: bool) -> str | None:
    """Why this rank's layers cannot move, or None when they can (every rank then takes the job's first)."""
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
            fsdp = "FSDP: blocks built by layer_factory= would not be sharded; leave it out (blocks are cloned)"
        if fsdp is not None:
            return fsdp
    first: LocalStage = pipeline.first
    if pipeline.deepspeed is not None:
        return pipeline.deepspeed.move_refusal()
    if pipeline.kind == "pipedream" and first.blocks is not None and (first.blocks.path
                                                                       or first.blocks.style.value != "ids"):
        return ("a PipeDream stream moves layers only in a stage module that is an nn.Sequential named by "
                "global layer id")
    return None

