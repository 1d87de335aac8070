"""``vpipe.attach``: the one line that puts vpipe underneath an existing pipeline trainer.

It takes the trainer's own objects and changes none of them structurally: a
``torch.distributed.pipelining`` schedule (one stage per rank, or several: Interleaved
1F1B, LoopedBFS, the zero-bubble schedules), vpipe's ``SchedulePipeDream``, DeepSpeed's
``PipelineEngine``, or a plain stage module for a hand-written loop. ``schedule.step`` (the
engine's ``train_batch``) is wrapped as an instance attribute, torch's stages get their
chunk methods wrapped by the tensor managers, the blocks get hooks and their containers
are edited in place when layers migrate; ``stage.submod`` and its ``forward`` are never
replaced. ``detach()`` removes every hook and wrapper; layers that moved stay where they are.

This module only wires the parts together (see :mod:`vpipe.rank` for each part's job). Its name is private
so that ``vpipe.attach`` is only ever the function: a public submodule of that name would replace it.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from vpipe import log as run_log
from vpipe.config import AUTO_BUDGET, VpipeConfig
from vpipe.control.curve import RunKeys
from vpipe.control.session import ControlOptions, ControlSession
from vpipe.engines import Engine, engine_for
from vpipe.log import decision
from vpipe.migration.carried import carried_state
from vpipe.migration.layer_manager import LayerListener, LayerManager
from vpipe.migration.messages import ControlMessenger
from vpipe.migration.patience import VoteMarks
from vpipe.migration.transfer import TransferChannel
from vpipe.monitors.source import TensorManagerSource
from vpipe.plan import Plan
from vpipe.planner import DEFAULT_PLANNER
from vpipe.rank.agreement import StoreAgreement, agree_on_blocks
from vpipe.rank.applying import PlanApplier
from vpipe.rank.boundary import PlanBoundary
from vpipe.rank.deepspeed_checkpoints import HomeCheckpoints
from vpipe.rank.edits import LayerEdits
from vpipe.rank.environment import check_environment
from vpipe.rank.local_layers import LocalLayers, find_pins
from vpipe.rank.memory import StageMemory
from vpipe.rank.metrics import MetricsWriter, parse_metric_kinds
from vpipe.rank.parts import RankParts
from vpipe.rank.plan_in_force import PlanInForce, StagePolicies
from vpipe.rank.replicas import ReplicaPlans, Replicas, ReplicaStats, check_replicas_alike
from vpipe.rank.resolved import planner_config, resolve_memory_budget
from vpipe.rank.stamps import stamp_state_dicts
from vpipe.rank.state import restore_vpipe_state, vpipe_state
from vpipe.rank.steps import MicroBatchCounter, StepDriver
from vpipe.rank.tracing import TraceWindow
from vpipe.settings import Settings
from vpipe.stage.batch_norm import DeferredNorms
from vpipe.stage.compiled import hoist_compiled
from vpipe.stage.fsdp import FsdpRoot, is_fully_sharded
from vpipe.stage.optimizers import optimizer_parts, raw_optimizers, wrapper_refusal
from vpipe.stage.pipeline import AttachTarget, check_optimizer
from vpipe.tensor_manager import TensorManager, install_on_stage
from vpipe.tensor_manager.pipelining import StageHandle

log = logging.getLogger("vpipe.attach")

# one optimizer over the rank's stages, or one per stage module: a list, or a container holding ``.optimizers``
OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None

__all__ = ["attach", "Vpipe", "VpipeConfig", "AUTO_BUDGET", "DEFAULT_PLANNER", "resolve_memory_budget"]


def attach(target: AttachTarget, *, optimizer: OptimizerArg = None, config: VpipeConfig | None = None,
           store: Store | None = None, **options: Any) -> Vpipe:
    """Turn vpipe on for this rank's stages. Every rank of the run must call it (it is collective).

    ``target`` is the trainer's schedule, DeepSpeed engine or stage module; ``optimizer`` the optimizer of
    this rank's stages (a PipeDream schedule and a DeepSpeed engine bring their own), or one optimizer per stage
    module in a list or a container holding them as ``.optimizers`` (torchtitan's); ``options`` override
    :class:`VpipeConfig` fields. ``store`` is the run's c10d store (default: the one
    ``torch.distributed`` was initialised with).
    """
    if config is not None and options:
        raise TypeError("pass either config= or keyword options, not both")
    settings = check_environment()  # every VPIPE_* variable, read once per process, checked here and handed on
    config = config or VpipeConfig.from_settings(settings, **options)
    return Vpipe(target, optimizer=optimizer, config=config, store=store, settings=settings)


class Vpipe:
    """vpipe on one rank: tensor managers, monitors + control session, layer manager, plan application."""

    def __init__(self, target: AttachTarget, *, optimizer: OptimizerArg, config: VpipeConfig,
                 store: Store | None = None, settings: Settings | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("vpipe.attach needs torch.distributed initialised first (torchrun or vpipe train)")
        self.config = config
        self.settings = settings if settings is not None else check_environment()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # in the world (logs, files)
        self._run_log = None if config.log_file is None else run_log.RunLog(config.log_file, rank=self.rank)
        self.engine: Engine = engine_for(target)  # what differs between the engines vpipe runs under
        self.pipeline = pipeline = self.engine.pipeline
        if optimizer is None:  # a PipeDream schedule's, the torch optimizer DeepSpeed steps (fp32)
            optimizer = self.engine.default_optimizer()
        # several optimizers (per model part, or per stage) read as one: a moved layer joins its kind on arrival
        self.optimizer = optimizer_parts(optimizer, {s.index: s.module for s in pipeline.stages})
        check_optimizer(self.optimizer, [s.module for s in pipeline.stages])
        self.stage_index = pipeline.first.index
        self.num_stages = pipeline.num_stages
        self._who = f"stage {self.stage_index}"
        self._undo: list[Callable[[], object]] = []  # what an undo returns is ignored
        self._detached = False
        self._exit_timeout_s: float | None = None
        trace, metrics = self._trace_window(), self._metrics_writer()  # their directories checked before set-up
        self.replicas = Replicas(pipeline.global_ranks(), self.world_size)  # peers by rank in the pipeline's group
        self.pipe_rank = pipeline.rank
        if self.replicas.count > 1 and self.engine.replica_refusal is not None:
            raise ValueError(f"vpipe.attach: {self.engine.replica_refusal}")
        self.agreement = StoreAgreement(store, rank=self.pipe_rank, world_size=pipeline.size,
                                        timeout_s=config.agree_timeout_s, pipeline=self.replicas.name)
        placement = agree_on_blocks(self.agreement, pipeline.stages, self.num_stages, config.layers)
        self.norms = DeferredNorms(pipeline.stages, config.carry) if config.deferred_batch_norm else None
        self._undo.extend([self.norms.undo] if self.norms is not None else [])
        self.carried = carried_state(pipeline, config.carry, config.on_move, self.agreement, self._who,
                                    refusal=self.engine.carry_refusal)
        peers = check_replicas_alike(
            self.agreement, world_rank=self.rank, world_size=self.world_size, who=self._who, replicas=self.replicas,
            layout={"schedule": pipeline.kind, "placement": [list(s) for s in placement],
                    "stage_ranks": list(pipeline.stage_ranks)}) if self.replicas.count > 1 else []
        capabilities = self.engine.capabilities(has_factory=config.layer_factory is not None,
                                                optimizer_refusal=wrapper_refusal(self.optimizer))
        self.move_refusal = self.agreement.agree_refusal(capabilities.moves, world_rank=self.rank,
                                                         world_size=self.world_size, who=self._who)
        self.memory_budget = resolve_memory_budget(config.memory_budget, pipeline.device)
        self.memories = self._memories()
        initial = Plan(epoch=0, stages=placement, policies=config.initial_policies())
        self.keys = RunKeys(self.settings)  # this attach's control-plane keys
        self.agreement.agree_run_secret(self._who, self.keys)
        # blocks compiled in place run their forward compiled and vpipe's hooks around it (before any hook goes on)
        hoisted = hoist_compiled(b for s in pipeline.stages if s.blocks is not None for b in s.blocks.blocks().values())
        if hoisted:
            self._undo.append(hoisted.undo)  # this attach's blocks only
        self.stage_handles: dict[int, StageHandle] = {}  # (filled by _start_tensor_managers)
        self.tensor_managers = self._start_tensor_managers(initial) if self._manages_activations() else {}
        shared = find_pins(pipeline, self.optimizer, self.carried.ids, fixed=self.engine.fixed_layers())
        facts = LocalLayers({s.index: s.blocks for s in pipeline.stages if s.blocks is not None}, shared,
                            builds_any=config.layer_factory is not None)
        self.session = self._start_session(initial, facts, peers)
        self.layer_manager = self._start_layer_manager(placement, shared)
        # the one owner of the plan in force: the parts that keep a copy are told of each commit, in this order
        policies = StagePolicies(self.tensor_managers, self.memories)
        self.plan_in_force = PlanInForce(initial, [*self.engine.followers(), self.layer_manager, policies,
                                                   self.session, self.carried])
        self._parts = parts = RankParts(pipeline, self.layer_manager, self.session, self.tensor_managers,
                                        self.memories, self.plan_in_force, self.engine)
        self.boundary = PlanBoundary(self.agreement, decides=self.pipe_rank == 0, lag_steps=config.apply_lag_steps,
                                     streamed=self.engine.streams, who=self._who,
                                     replicas=ReplicaPlans(self.agreement.job) if self.replicas.count > 1 else None,
                                     follows=not self.replicas.leads)
        self.driver = StepDriver(parts, boundary=self.boundary, applier=PlanApplier(parts, self.move_refusal),
                                 micro_batches=pipeline.micro_batches(config.micro_batches),
                                 logs_steps=self.num_stages - 1 in self._local, counter=self._micro_batch_counter(),
                                 stage_handles=self.stage_handles, trace=trace, metrics=metrics, norms=self.norms)
        self.edits = LayerEdits(parts, agreement=self.agreement, driver=self.driver,
                                has_factory=config.layer_factory is not None, refusal=capabilities.edits,
                                who=self._who)
        self._install()
        lm = self.layer_manager  # state dicts say which blocks they hold: one from another placement is refused
        self._undo.append(stamp_state_dicts([(s.module, partial(lm.layers_of, s.index)) for s in pipeline.stages],
                                            raw_optimizers(self.optimizer), lambda: list(lm.layer_ids)))
        atexit.register(self._at_exit)  # a script that never calls detach() still shuts vpipe down cleanly
        for stage in pipeline.stages:
            assert stage.blocks is not None  # agree_on_blocks set every local stage's blocks
            decision("attached", f"vpipe attached to stage {stage.index} of {self.num_stages}", stage=stage.index,
                     layers=list(placement[stage.index]), schedule=self.engine.name, memory_budget=self.memory_budget,
                     planning=config.planning, container=stage.blocks.path or "<stage module>",
                     keys=stage.blocks.style.value, stages_on_rank=self._local)
            if self.move_refusal is not None:
                decision("moves_off", f"stage {stage.index}: layers will not move ({self.move_refusal}); "
                         "swap and recompute plans still apply", stage=stage.index, reason=self.move_refusal)

    def _trace_window(self) -> TraceWindow | None:
        steps = self.config.trace_steps
        if steps is None:
            return None
        window = TraceWindow(steps, self.config.trace_dir, rank=self.rank, stages=self._local)
        self._undo.append(window.close)  # a window still open when vpipe detaches writes what it has
        return window

    def _metrics_writer(self) -> MetricsWriter | None:
        kinds = parse_metric_kinds(self.config.metrics)
        if not kinds:
            return None
        writer = MetricsWriter(kinds, self.config.metrics_dir, rank=self.rank)
        self._undo.append(writer.close)
        return writer

    @property
    def _local(self) -> list[int]:
        return [s.index for s in self.pipeline.stages]

    def _memories(self) -> dict[int, StageMemory]:
        """Each local stage's budget for activations: shares of what the rank's fixed bytes leave."""
        siblings: list[StageMemory] = []
        together = self.pipeline.in_flight_together()
        memories = {}
        for stage in self.pipeline.stages:
            memories[stage.index] = StageMemory(stage.index, stage.module, self.optimizer, self.memory_budget,
                                                weight_versions=self.engine.weight_versions(stage.index),
                                                siblings=siblings, together=together)
        for memory in memories.values():
            memory.activation_budget()  # a budget below the fixed bytes fails here, at attach
        return memories

    def _manages_activations(self) -> bool:
        """Whether tensor managers keep, swap or recompute the blocks' activations (DeepSpeed's own checkpointing
        recomputes them already: never twice)."""
        itself = self.engine.recomputes_itself()
        if self.config.tensor_manager and itself is not None:
            decision("tensor_manager_off", f"stage {self.stage_index}: {itself}; vpipe does not swap or recompute "
                     "them, and still moves them", stage=self.stage_index)
            return False
        return self.config.tensor_manager

    def _start_tensor_managers(self, initial: Plan) -> dict[int, TensorManager]:
        managers = {}
        for stage in self.pipeline.stages:
            assert stage.blocks is not None
            layers = stage.blocks.blocks()
            kwargs: dict[str, Any] = {"device": self.pipeline.device,
                                      "budget_bytes": self.memories[stage.index].activation_budget(),
                                      "policies": {lid: initial.policy(lid) for lid in layers},
                                      "prefetch_alloc": self.settings.prefetch_alloc}
            if self.config.min_swap_bytes is not None:
                kwargs["min_swap_bytes"] = self.config.min_swap_bytes
            if self.config.host_pool_bytes is not None:
                kwargs["host_pool_bytes"] = self.config.host_pool_bytes
            manager = TensorManager(layers, **kwargs)
            if stage.pipeline_stage is not None:
                handle = install_on_stage(stage.pipeline_stage, manager)
                self.stage_handles[stage.index] = handle
                self._undo.append(handle.remove)
            self._undo.append(manager.close)
            managers[stage.index] = manager
        return managers

    def _start_session(self, initial: Plan, facts: LocalLayers, peers: Sequence[int]) -> ControlSession:
        config, pipeline = self.config, self.pipeline
        if config.planning and self.engine.hand_written and config.micro_batches is None:
            log.warning("vpipe.attach(module): micro_batches= not given, the planner assumes 1 micro-batch per step "
                        "(a pipeline that then never overlaps stages, so it will not rebalance)")
        plans = config.planning and self.replicas.leads  # the leading replica's last stage starts the one daemon
        planning = plans and self.num_stages - 1 in self._local
        options = ControlOptions(sample_every=config.sample_every, max_sample_every=config.sampling_cap,
                                 planner=config.planner if plans else None, log_file=config.log_file,
                                 planner_timeout_s=self.settings.planner_timeout_s,
                                 control_host=self.settings.control_host, keys=self.keys,
                                 planner_config=planner_config(config, pipeline, self.memory_budget,
                                                               self.move_refusal is None) if planning else None)
        combine = ReplicaStats(self.agreement.job, world_rank=self.rank, peers=peers, leads=self.replicas.leads,
                               timeout_s=self.agreement.timeout_s) if peers else None  # one planner, every replica
        session = ControlSession(
            {s.index: s.blocks.blocks() for s in pipeline.stages if s.blocks is not None}, rank=self.pipe_rank,
            stage_ranks=pipeline.stage_ranks, store=self.agreement.store, world_size=pipeline.size,
            device=pipeline.device, optimizer=self.optimizer,
            saved_sources={v: TensorManagerSource(m) for v, m in self.tensor_managers.items()}, plan=initial,
            options=options, pipeline_stages={s.index: s.pipeline_stage for s in pipeline.stages
                                              if s.pipeline_stage is not None},
            layer_facts=facts, combine_records=combine,
            # modules outside the blocks: their cost is the stage's
            stage_modules={s.index: s.module for s in pipeline.stages
                           if s.blocks is not None and s.blocks.container is not s.module},
            pulse_modules=[s.module for s in pipeline.stages])
        self._undo.append(lambda: session.close(self._exit_timeout_s))
        return session

    def _start_layer_manager(self, placement: tuple[tuple[int, ...], ...], shared: dict[int, str]) -> LayerManager:
        pipeline = self.pipeline
        listeners: dict[int, list[LayerListener]] = {}
        for stage in pipeline.stages:  # the parts that keep per-layer state follow their stage's layers
            mine = listeners[stage.index] = [self.session.monitors[stage.index]]
            if stage.index in self.tensor_managers:
                mine.append(self.tensor_managers[stage.index])
            mine.extend(self.engine.followers())  # the engine's own record of the layers too
            if is_fully_sharded(stage.module) and stage.blocks is not None:  # its FSDP root too
                mine.append(FsdpRoot(stage.module, stage.blocks.blocks()))
        manager = LayerManager(
            {s.index: s.blocks for s in pipeline.stages if s.blocks is not None}, placement=placement,
            stage_ranks=pipeline.stage_ranks, optimizer=self.optimizer,
            factory=self.norms.factory(self.config.layer_factory) if self.norms else self.config.layer_factory,
            specs=self.config.specs, messenger=ControlMessenger(self.session.plane, self.pipe_rank),
            channel=TransferChannel(pipeline.device, world_ranks=self.replicas.world_ranks, marks=VoteMarks(
                self.agreement.job, rank=self.rank, world_size=self.world_size)), device=pipeline.device,
            timeout_s=self.config.migration_timeout_s, faults=self.settings.faults.migration_faults(self.rank),
            shared=shared, listeners=listeners, carry=self.carried)
        self._undo.append(manager.close)
        return manager

    def _micro_batch_counter(self) -> MicroBatchCounter | None:
        """A hand-written loop's micro-batch counter: the n-th forward of the stage module in a step is number n."""
        if not self.engine.counts_forwards or not self.tensor_managers:
            return None
        if self.engine.hand_written and self.optimizer is None:
            return None
        counter = MicroBatchCounter(self.pipeline.first.module, self.tensor_managers[self.stage_index])
        self._undo.append(counter.remove)
        return counter

    def _install(self) -> None:
        schedule, name = self.pipeline.schedule, self.engine.step_method  # step, or DeepSpeed's train_batch
        if name is not None:
            original = getattr(schedule, name)

            def step(*args: Any, **kwargs: Any) -> Any:
                return self.driver.run(original, *args, **kwargs)

            setattr(schedule, name, step)  # instance attribute over the class method
            self._undo.append(lambda: schedule.__dict__.pop(name, None))
            home = self.engine.checkpoint_home
            if home is not None:  # the engine's own checkpoints are written on the partition it built
                self._undo.append(HomeCheckpoints(self._parts, home).install())
            return
        if self.optimizer is None:
            raise ValueError("attaching to a stage module needs optimizer=: its step() marks the step boundary")
        self.driver.begin()
        handle = self.optimizer.register_step_post_hook(lambda *_: self.driver.module_step_done())
        self._undo.append(handle.remove)

    # ------------------------------------------------------------------ what the trainer calls
    def request_plan(self, plan: Plan, at_step: int) -> None:
        """Apply ``plan`` before step ``at_step`` (forced moves; every rank must call it identically)."""
        self.plan_in_force.check(plan, self.plan_in_force.order, self.num_stages)
        self.boundary.request(plan, at_step, self.driver.iteration)

    def add_layers(self, position: int, specs: list[Any]) -> list[int]:
        """Insert layers before model position ``position`` (every rank calls it at the same step boundary)."""
        return self.edits.add_layers(position, specs)

    def remove_layers(self, layer_ids: list[int]) -> None:
        """Remove layers by id (every rank calls it at the same step boundary)."""
        self.edits.remove_layers(layer_ids)

    @property
    def iteration(self) -> int:
        return self.driver.iteration

    @property
    def boundary_s(self) -> list[float]:
        return self.driver.boundary_s

    @property
    def placement(self) -> tuple[tuple[int, ...], ...]:
        return self.plan_in_force.placement

    @property
    def layer_ids(self) -> list[int]:
        return self.layer_manager.layer_ids

    @property
    def tensor_manager(self) -> TensorManager | None:
        """The tensor manager of a rank that runs one stage (``tensor_managers`` holds one per stage)."""
        if len(self.pipeline.stages) != 1:
            raise ValueError(f"rank {self.rank} runs stages {self._local}: use tensor_managers[stage]")
        return self.tensor_managers.get(self.stage_index)

    def state(self) -> dict[str, Any]:
        return {"epoch": self.plan_in_force.epoch, "stages": [list(s) for s in self.plan_in_force.placement],
                "iteration": self.driver.iteration}

    def state_dict(self) -> dict[str, Any]:
        """vpipe's part of a checkpoint (plain JSON values): plan epoch, step, placement, policies, next layer id."""
        return vpipe_state(self._parts, self.driver.iteration)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's vpipe state (every rank calls it with the same state, before a step)."""
        restore_vpipe_state(state, self._parts, driver=self.driver, hand_written=self.engine.hand_written,
                            who=self.stage_index)

    def fixed_bytes(self) -> int:
        """Bytes this rank's stages hold whatever their activation policies (weights, gradients, optimizer state)."""
        return sum(memory.fixed_bytes() for memory in self.memories.values())

    def memory_report(self) -> dict[str, Any]:
        """This rank's memory as vpipe accounts it: budget, fixed bytes, peak saved activations, policies."""
        peak = sum(tm.ledger.peak for tm in self.tensor_managers.values())
        fixed = self.fixed_bytes()
        policies = {str(lid): p.value for tm in self.tensor_managers.values() for lid, p in tm.policies().items()}
        return {"budget_bytes": self.memory_budget, "fixed_bytes": fixed, "peak_saved_bytes": peak,
                "footprint_bytes": fixed + peak, "policies": policies}

    # ------------------------------------------------------------------ the end
    def _at_exit(self) -> None:
        if not self._detached:  # after an uncaught exception the peers' last stats may never come: no wait for them
            self._exit_timeout_s = 0.0 if getattr(sys, "last_value", None) is not None else 5.0
            self.detach()

    def detach(self) -> None:
        """Remove every hook and wrapper vpipe installed, and this rank's store keys (the current placement stays)."""
        if self._detached:
            return
        self._detached = True
        atexit.unregister(self._at_exit)
        errors = []
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - undo as much as possible, then report
                errors.append(e)
        self._undo.clear()
        self.agreement.clear()
        for stage in self.pipeline.stages:
            decision("detached", f"vpipe detached from stage {stage.index}", stage=stage.index)
        if self._run_log is not None:  # after the last line it takes
            self._run_log.close()
        if errors:
            raise RuntimeError(f"vpipe.detach could not undo everything: {errors[0]}") from errors[0]
