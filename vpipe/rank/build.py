"""One rank's parts of ``vpipe.attach``, built all or nothing.

Attach puts things on the trainer's objects (hooks on the stage modules and their blocks, wrappers over the
schedule's and the stages' methods, hooks on the optimizer, BatchNorms made deferred, compiled blocks hoisted)
and opens things of its own (a run log's handler, a timeline window, metrics files, control sockets and their
threads, a planner daemon, a transfer group, store keys). Each step below registers its undo in the attach's
:class:`Cleanups` the moment it has made its thing. When a step fails, every undo registered so far runs,
newest first, and the step's own exception propagates: the trainer's modules and optimizers are exactly as
before, and it may attach again. When every step succeeds the undos are kept: they are the detach. (Store keys
are the one thing a failure leaves, see :func:`_clear_keys`.) The two parts that work with other processes,
the control session and the layer manager, are made in :mod:`vpipe.rank.peer_parts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.distributed.distributed_c10d import Store

from vpipe import log as run_log
from vpipe.config import VpipeConfig
from vpipe.control.curve import RunKeys
from vpipe.control.session import ControlSession
from vpipe.engines import Engine, engine_for
from vpipe.log import decision
from vpipe.migration.carried import CarriedState, carried_state
from vpipe.migration.layer_manager import LayerManager
from vpipe.plan import Plan
from vpipe.rank.agreement import StoreAgreement, agree_on_blocks
from vpipe.rank.applying import PlanApplier
from vpipe.rank.boundary import PlanBoundary
from vpipe.rank.cleanups import Cleanups
from vpipe.rank.deepspeed_checkpoints import HomeCheckpoints
from vpipe.rank.edits import LayerEdits
from vpipe.rank.local_layers import LocalLayers, find_pins
from vpipe.rank.memory import StageMemory
from vpipe.rank.metrics import MetricsWriter, parse_metric_kinds
from vpipe.rank.parts import RankParts
from vpipe.rank.peer_parts import start_layer_manager, start_session
from vpipe.rank.plan_in_force import PlanInForce, StagePolicies
from vpipe.rank.replicas import ReplicaPlans, Replicas, ReplicaStats, check_replicas_alike
from vpipe.rank.resolved import resolve_memory_budget
from vpipe.rank.stamps import stamp_state_dicts
from vpipe.rank.steps import MicroBatchCounter, StepDriver
from vpipe.rank.tracing import TraceWindow
from vpipe.settings import Settings
from vpipe.stage.batch_norm import DeferredNorms
from vpipe.stage.compiled import Hoisted, hoist_compiled
from vpipe.stage.optimizers import optimizer_parts, raw_optimizers, wrapper_refusal
from vpipe.stage.pipeline import AttachTarget, Pipeline, check_optimizer
from vpipe.stage.quiet_inference import install_quiet_inference
from vpipe.tensor_manager import TensorManager, install_on_stage
from vpipe.tensor_manager.pipelining import StageHandle

__all__ = ["RankBuild", "build_rank"]

_MISSING = object()


@dataclass(frozen=True)
class RankBuild:
    """What :func:`build_rank` made on this rank, and the undos
    (:attr:`cleanups`) that take it apart again."""

    cleanups: Cleanups
    engine: Engine
    pipeline: Pipeline
    optimizer: torch.optim.Optimizer | None
    replicas: Replicas
    agreement: StoreAgreement
    norms: DeferredNorms | None
    carried: CarriedState
    move_refusal: str | None
    memory_budget: int | None
    memories: dict[int, StageMemory]
    keys: RunKeys
    stage_handles: dict[int, StageHandle]
    tensor_managers: dict[int, TensorManager]
    session: ControlSession
    layer_manager: LayerManager
    plan_in_force: PlanInForce
    parts: RankParts
    boundary: PlanBoundary
    driver: StepDriver
    edits: LayerEdits


def build_rank(target: AttachTarget, *, optimizer: Any, config: VpipeConfig, store: Store | None,
               settings: Settings, rank: int, world_size: int) -> RankBuild:
    """Build this rank's parts (``rank`` and ``world_size`` in the world), all or nothing (see the module)."""
    cleanups = Cleanups()
    with cleanups.until_built():
        open_run_log(config, rank, cleanups)
        engine = engine_for(target)  # what differs between the engines vpipe runs under
        pipeline = engine.pipeline
        cleanups.add(partial(_say_detached, pipeline, cleanups))  # the run log's last lines
        if optimizer is None:  # a PipeDream schedule's, the torch optimizer DeepSpeed steps (fp32)
            optimizer = engine.default_optimizer()
        # several optimizers (per model part, or per stage) read as
        # one: a moved layer joins its kind on arrival
        optimizer = optimizer_parts(optimizer, {s.index: s.module for s in pipeline.stages})
        check_optimizer(optimizer, [s.module for s in pipeline.stages])
        if engine.hand_written and optimizer is None:
            raise ValueError("attaching to a stage module needs optimizer=: its step() "
                             "marks the step boundary")
        local, who = [s.index for s in pipeline.stages], f"stage {pipeline.first.index}"
        trace = open_trace_window(config, rank, local, cleanups)  # their directories checked before set-up
        metrics = open_metrics_writer(config, rank, cleanups)
        replicas = Replicas(pipeline.global_ranks(), world_size)  # peers by rank in the pipeline's group
        if replicas.count > 1 and engine.replica_refusal is not None:
            raise ValueError(f"vpipe.attach: {engine.replica_refusal}")
        agreement = open_agreement(store, pipeline, replicas, config, cleanups)
        placement = agree_on_blocks(agreement, pipeline.stages, pipeline.num_stages, config.layers)
        norms = defer_batch_norms(pipeline, config, cleanups)
        quiet_redone_inference(pipeline, cleanups)
        carried = carried_state(pipeline, config.carry, config.on_move, agreement, who,
                                refusal=engine.carry_refusal)
        peers = check_replicas_alike(
            agreement, world_rank=rank, world_size=world_size, who=who, replicas=replicas,
            layout={"schedule": pipeline.kind, "placement": [list(s) for s in placement],
                    "stage_ranks": list(pipeline.stage_ranks)}) if replicas.count > 1 else []
        capabilities = engine.capabilities(has_factory=config.layer_factory is not None,
                                           optimizer_refusal=wrapper_refusal(optimizer))
        move_refusal = agreement.agree_refusal(capabilities.moves, world_rank=rank, world_size=world_size,
                                               who=who)
        memory_budget = resolve_memory_budget(config.memory_budget, pipeline.device)
        memories = stage_memories(pipeline, engine, optimizer, memory_budget)
        initial = Plan(epoch=0, stages=placement, policies=config.initial_policies())
        keys = agree_run_keys(settings, agreement, who, cleanups)
        # blocks compiled in place: their forward compiled, vpipe's hooks around
        hoisted = hoist(pipeline, cleanups)
        managers: dict[int, TensorManager] = {}
        handles: dict[int, StageHandle] = {}
        if manages_activations(engine, config, pipeline.first.index):
            managers, handles = start_tensor_managers(pipeline, memories, initial, config, settings, cleanups)
        shared = find_pins(pipeline, optimizer, {*carried.ids, *map(id, engine.own_copies())},
                           fixed=engine.fixed_layers())
        facts = LocalLayers({s.index: s.blocks for s in pipeline.stages if s.blocks is not None}, shared,
                            builds_any=config.layer_factory is not None)
        combine = ReplicaStats(agreement.job, world_rank=rank, peers=peers, leads=replicas.leads,
                               timeout_s=agreement.timeout_s) if peers else None  # one planner, every replica
        session = start_session(pipeline, engine, config, settings, optimizer=optimizer, managers=managers,
                                initial=initial, facts=facts, keys=keys, replicas=replicas,
                                agreement=agreement,
                                combine=combine, move_refusal=move_refusal, memory_budget=memory_budget,
                                cleanups=cleanups)
        layer_manager = start_layer_manager(pipeline, engine, config, settings, optimizer=optimizer,
                                            placement=placement, shared=shared, managers=managers,
                                            session=session,
                                            replicas=replicas, agreement=agreement, norms=norms,
                                            carried=carried,
                                            rank=rank, world_size=world_size, cleanups=cleanups,
                                            hoisted=hoisted)
        # the one owner of the plan in force: the parts that keep a
        # copy are told of each commit, in this order
        plan_in_force = PlanInForce(initial, [*engine.followers(), layer_manager,
                                              StagePolicies(managers, memories),
                                              session, carried])
        parts = RankParts(pipeline, layer_manager, session, managers, memories, plan_in_force, engine)
        boundary = PlanBoundary(agreement, decides=pipeline.rank == 0, lag_steps=config.apply_lag_steps,
                                streamed=engine.streams, who=who,
                                replicas=ReplicaPlans(agreement.job) if replicas.count > 1 else None,
                                follows=not replicas.leads)
        driver = StepDriver(parts, boundary=boundary, applier=PlanApplier(parts, move_refusal),
                            micro_batches=pipeline.micro_batches(config.micro_batches),
                            logs_steps=pipeline.num_stages - 1 in local, stage_handles=handles, trace=trace,
                            counter=count_micro_batches(pipeline, engine, managers, cleanups),
                            metrics=metrics, norms=norms)
        edits = LayerEdits(parts, agreement=agreement, driver=driver,
                           has_factory=config.layer_factory is not None,
                           refusal=capabilities.edits, who=who)
        install_step(pipeline, engine, parts, optimizer, driver, cleanups)
        stamp(pipeline, layer_manager, optimizer, cleanups)
        _say_attached(pipeline, engine, config, placement, memory_budget, move_refusal)
    return RankBuild(cleanups=cleanups, engine=engine, pipeline=pipeline, optimizer=optimizer,
                     replicas=replicas,
                     agreement=agreement, norms=norms, carried=carried, move_refusal=move_refusal,
                     memory_budget=memory_budget, memories=memories, keys=keys, stage_handles=handles,
                     tensor_managers=managers, session=session, layer_manager=layer_manager,
                     plan_in_force=plan_in_force, parts=parts, boundary=boundary, driver=driver, edits=edits)


# ------------------------------------------------------------- the steps: each registers its undo as it makes
def open_run_log(config: VpipeConfig, rank: int, cleanups: Cleanups) -> None:
    if config.log_file is not None:
        cleanups.add(run_log.RunLog(config.log_file, rank=rank).close)  # the last undo: it takes every line


def open_trace_window(config: VpipeConfig, rank: int, local: list[int],
                      cleanups: Cleanups) -> TraceWindow | None:
    if config.trace_steps is None:
        return None
    window = TraceWindow(config.trace_steps, config.trace_dir, rank=rank, stages=local)
    cleanups.add(window.close)  # a window still open when vpipe detaches writes what it has
    return window


def open_metrics_writer(config: VpipeConfig, rank: int, cleanups: Cleanups) -> MetricsWriter | None:
    kinds = parse_metric_kinds(config.metrics)
    if not kinds:
        return None
    writer = MetricsWriter(kinds, config.metrics_dir, rank=rank)
    cleanups.add(writer.close)
    return writer


def open_agreement(store: Store | None, pipeline: Pipeline, replicas: Replicas, config: VpipeConfig,
                   cleanups: Cleanups) -> StoreAgreement:
    agreement = StoreAgreement(store, rank=pipeline.rank, world_size=pipeline.size,
                               timeout_s=config.agree_timeout_s,
                               pipeline=replicas.name)
    cleanups.add(partial(_clear_keys, agreement, cleanups))  # once every part that reads them is undone
    return agreement


def defer_batch_norms(pipeline: Pipeline, config: VpipeConfig, cleanups: Cleanups) -> DeferredNorms | None:
    if not config.deferred_batch_norm:
        return None
    norms = DeferredNorms(pipeline.stages, config.carry)  # (undoes its own part-way conversions)
    cleanups.add(norms.undo)
    return norms


def quiet_redone_inference(pipeline: Pipeline, cleanups: Cleanups) -> None:
    """Shape inference that vpipe has torch redo runs without the user's hooks, buffers and RNG put back."""
    for stage in pipeline.stages:
        if stage.pipeline_stage is not None:
            undo = install_quiet_inference(stage.pipeline_stage)
            if undo is not None:
                cleanups.add(undo)


def stage_memories(pipeline: Pipeline, engine: Engine, optimizer: torch.optim.Optimizer | None,
                   budget: int | None) -> dict[int, StageMemory]:
    """Each local stage's budget for activations: shares of what the rank's fixed bytes leave."""
    siblings: list[StageMemory] = []
    together = pipeline.in_flight_together()
    memories = {}
    for stage in pipeline.stages:
        memories[stage.index] = StageMemory(stage.index, stage.module, optimizer, budget, siblings=siblings,
                                            weight_versions=engine.weight_versions(stage.index),
                                            together=together)
    for memory in memories.values():
        memory.activation_budget()  # a budget below the fixed bytes fails here, at attach
    return memories


def agree_run_keys(settings: Settings, agreement: StoreAgreement, who: str, cleanups: Cleanups) -> RunKeys:
    keys = RunKeys(settings)  # this attach's control-plane keys
    cleanups.add(keys.close)  # the key file a daemon started by hand reads, if one gets made
    agreement.agree_run_secret(who, keys)
    return keys


def hoist(pipeline: Pipeline, cleanups: Cleanups) -> Hoisted:
    hoisted = hoist_compiled(b for s in pipeline.stages if s.blocks is not None
                             for b in s.blocks.blocks().values())
    cleanups.add(hoisted.undo)  # this attach's blocks only (and the layer factory's, which join it)
    return hoisted


def manages_activations(engine: Engine, config: VpipeConfig, stage_index: int) -> bool:
    """Whether tensor managers keep, swap or recompute the blocks' activations (DeepSpeed's own checkpointing
    recomputes them already: never twice)."""
    itself = engine.recomputes_itself()
    if config.tensor_manager and itself is not None:
        decision("tensor_manager_off",
                 f"stage {stage_index}: {itself}; vpipe does not swap or recompute them, "
                 "and still moves them", stage=stage_index)
        return False
    return config.tensor_manager


def start_tensor_managers(pipeline: Pipeline, memories: dict[int, StageMemory], initial: Plan,
                          config: VpipeConfig,
                          settings: Settings, cleanups: Cleanups
                          ) -> tuple[dict[int, TensorManager], dict[int, StageHandle]]:
    managers, handles = {}, {}
    for stage in pipeline.stages:
        assert stage.blocks is not None
        layers = stage.blocks.blocks()
        kwargs: dict[str, Any] = {"device": pipeline.device,
                                  "budget_bytes": memories[stage.index].activation_budget(),
                                  "policies": {lid: initial.policy(lid) for lid in layers},
                                  "prefetch_alloc": settings.prefetch_alloc}
        if config.min_swap_bytes is not None:
            kwargs["min_swap_bytes"] = config.min_swap_bytes
        if config.host_pool_bytes is not None:
            kwargs["host_pool_bytes"] = config.host_pool_bytes
        manager = managers[stage.index] = TensorManager(layers, **kwargs)
        cleanups.add(manager.close)
        if stage.pipeline_stage is not None:
            handle = handles[stage.index] = install_on_stage(stage.pipeline_stage, manager)
            cleanups.add(handle.remove)
    return managers, handles


def count_micro_batches(pipeline: Pipeline, engine: Engine, managers: dict[int, TensorManager],
                        cleanups: Cleanups) -> MicroBatchCounter | None:
    """A hand-written loop's micro-batch counter: the n-th forward
    of the stage module in a step is number n."""
    if not engine.counts_forwards or not managers:
        return None
    counter = MicroBatchCounter(pipeline.first.module, managers[pipeline.first.index])
    cleanups.add(counter.remove)
    return counter


def install_step(pipeline: Pipeline, engine: Engine, parts: RankParts,
                 optimizer: torch.optim.Optimizer | None,
                 driver: StepDriver, cleanups: Cleanups) -> None:
    """Run every step through the driver: the schedule's step (DeepSpeed's train_batch) wrapped as an instance
    attribute, or a hand-written loop's optimizer step marking the boundary."""
    schedule, name = pipeline.schedule, engine.step_method
    if name is None:
        assert optimizer is not None  # (refused at the start)
        driver.begin()
        handle = optimizer.register_step_post_hook(lambda *_: driver.module_step_done())
        cleanups.add(handle.remove)
        return
    original, before = getattr(schedule, name), schedule.__dict__.get(name, _MISSING)

    def step(*args: Any, **kwargs: Any) -> Any:
        return driver.run(original, *args, **kwargs)

    setattr(schedule, name, step)  # instance attribute over the class method
    cleanups.add(partial(_put_back, schedule, name, before))
    # the engine's own checkpoints are written on the partition it built
    if engine.checkpoint_home is not None:
        cleanups.add(HomeCheckpoints(parts, engine.checkpoint_home).install())


def stamp(pipeline: Pipeline, layer_manager: LayerManager, optimizer: torch.optim.Optimizer | None,
          cleanups: Cleanups) -> None:
    """State dicts say which blocks they hold: one from another placement is refused."""
    lm = layer_manager
    cleanups.add(stamp_state_dicts([(s.module, partial(lm.layers_of, s.index)) for s in pipeline.stages],
                                   raw_optimizers(optimizer), lambda: list(lm.layer_ids)))


# ------------------------------------------------------------------ helpers
def _put_back(owner: Any, name: str, before: Any) -> None:
    """``owner``'s instance attribute ``name`` as it was (none, or the one it had)."""
    if before is _MISSING:
        owner.__dict__.pop(name, None)
    else:
        setattr(owner, name, before)


def _say_attached(pipeline: Pipeline, engine: Engine, config: VpipeConfig,
                  placement: tuple[tuple[int, ...], ...],
                  memory_budget: int | None, move_refusal: str | None) -> None:
    local = [s.index for s in pipeline.stages]
    for stage in pipeline.stages:
        assert stage.blocks is not None  # agree_on_blocks set every local stage's blocks
        decision("attached", f"vpipe attached to stage {stage.index} of {pipeline.num_stages}",
                 stage=stage.index,
                 layers=list(placement[stage.index]), schedule=engine.name, memory_budget=memory_budget,
                 planning=config.planning, container=stage.blocks.path or "<stage module>",
                 keys=stage.blocks.style.value, stages_on_rank=local)
        if move_refusal is not None:
            decision("moves_off",
                     f"stage {stage.index}: layers will not move ({move_refusal}); swap and recompute "
                     "plans still apply", stage=stage.index, reason=move_refusal)


def _clear_keys(agreement: StoreAgreement, cleanups: Cleanups) -> None:
    """This rank's store keys, at detach. A failed attach leaves them: a peer failing the same collective
    step may not have read them yet, and no later attach reads them (each has a namespace of its own)."""
    if cleanups.built:
        agreement.clear()


def _say_detached(pipeline: Pipeline, cleanups: Cleanups) -> None:
    """A detach's last lines (a failed attach never said it attached)."""
    if cleanups.built:
        for stage in pipeline.stages:
            decision("detached", f"vpipe detached from stage {stage.index}", stage=stage.index)

