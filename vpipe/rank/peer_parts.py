"""The rank's parts of ``vpipe.attach`` that work with other processes: its control session and layer manager.

:func:`~vpipe.rank.build.build_rank` makes them in this order, each with its undo registered the
moment it is made. The control session measures the rank's stages and carries their statistics
along the pipeline to the planner daemon (which the last stage of the leading replica starts)
and the plans back; the layer manager moves blocks to and from the neighbouring stages when a
plan says so, over the session's message channel and a transfer channel of its own, with every
part that keeps per-layer state told of the blocks that came and went. Apart from the build
because these two are wired from most of what the build made before them (the engine, the
optimizer, the tensor managers, the agreement, the replicas), and their wiring is most of the
build's length.
"""

from __future__ import annotations

import logging

import torch

from vpipe.config import VpipeConfig
from vpipe.control.curve import RunKeys
from vpipe.control.session import ControlOptions, ControlSession
from vpipe.engines import Engine
from vpipe.migration.block_edits import LayerListener
from vpipe.migration.carried import CarriedState
from vpipe.migration.layer_manager import LayerManager
from vpipe.migration.messages import ControlMessenger
from vpipe.migration.patience import VoteMarks
from vpipe.migration.transfer import TransferChannel
from vpipe.monitors.source import TensorManagerSource
from vpipe.plan import Plan
from vpipe.rank.agreement import StoreAgreement
from vpipe.rank.cleanups import Cleanups
from vpipe.rank.local_layers import LocalLayers
from vpipe.rank.replicas import Replicas, ReplicaStats
from vpipe.rank.resolved import planner_config
from vpipe.settings import Settings
from vpipe.stage.batch_norm import DeferredNorms
from vpipe.stage.compiled import Hoisted, hoisting_factory
from vpipe.stage.fsdp import FsdpRoot, is_fully_sharded
from vpipe.stage.pipeline import Pipeline
from vpipe.tensor_manager import TensorManager

log = logging.getLogger("vpipe.attach")

__all__ = ["start_session", "start_layer_manager"]


def start_session(pipeline: Pipeline, engine: Engine, config: VpipeConfig, settings: Settings,
                  *, optimizer: torch.optim.Optimizer | None, managers: dict[int, TensorManager],
                  initial: Plan,
                  facts: LocalLayers, keys: RunKeys, replicas: Replicas, agreement: StoreAgreement,
                  combine: ReplicaStats | None, move_refusal: str | None, memory_budget: int | None,
                  cleanups: Cleanups) -> ControlSession:
    if config.planning and engine.hand_written and config.micro_batches is None:
        log.warning("vpipe.attach(module): micro_batches= not given, the planner assumes 1 micro-batch per "
                    "step (a pipeline that then never overlaps stages, so it will not rebalance)")
    plans = config.planning and replicas.leads  # the leading replica's last stage starts the one daemon
    planning = plans and any(s.index == pipeline.num_stages - 1 for s in pipeline.stages)
    options = ControlOptions(sample_every=config.sample_every, max_sample_every=config.sampling_cap,
                             planner=config.planner if plans else None, log_file=config.log_file,
                             planner_timeout_s=settings.planner_timeout_s, control_host=settings.control_host,
                             keys=keys, planner_config=planner_config(config, pipeline, memory_budget,
                                                                      move_refusal is None) if planning
                             else None)
    session = ControlSession(  # (closes what it opened if it cannot be made whole)
        {s.index: s.blocks.blocks() for s in pipeline.stages if s.blocks is not None}, rank=pipeline.rank,
        stage_ranks=pipeline.stage_ranks, store=agreement.store, world_size=pipeline.size,
                             device=pipeline.device,
        optimizer=optimizer, saved_sources={v: TensorManagerSource(m) for v, m in managers.items()},
                             plan=initial,
        options=options, pipeline_stages={s.index: s.pipeline_stage for s in pipeline.stages
                                          if s.pipeline_stage is not None},
        layer_facts=facts, combine_records=combine,
        # modules outside the blocks: their cost is the stage's
        stage_modules={s.index: s.module for s in pipeline.stages
                       if s.blocks is not None and s.blocks.container is not s.module},
        pulse_modules=[s.module for s in pipeline.stages])
    cleanups.add(lambda: session.close(cleanups.wait_s))
    return session


def start_layer_manager(pipeline: Pipeline, engine: Engine, config: VpipeConfig, settings: Settings,
                        *, optimizer: torch.optim.Optimizer | None, placement: tuple[tuple[int, ...], ...],
                        shared: dict[int, str], managers: dict[int, TensorManager], session: ControlSession,
                        replicas: Replicas, agreement: StoreAgreement, norms: DeferredNorms | None,
                        carried: CarriedState, rank: int, world_size: int, cleanups: Cleanups,
                        hoisted: Hoisted) -> LayerManager:
    listeners: dict[int, list[LayerListener]] = {}
    for stage in pipeline.stages:  # the parts that keep per-layer state follow their stage's layers
        mine = listeners[stage.index] = [session.monitors[stage.index]]
        if stage.index in managers:
            mine.append(managers[stage.index])
        mine.extend(engine.followers())  # the engine's own record of the layers too
        if is_fully_sharded(stage.module) and stage.blocks is not None:  # its FSDP root too
            mine.append(FsdpRoot(stage.module, stage.blocks.blocks()))
    channel = TransferChannel(pipeline.device, world_ranks=replicas.world_ranks, marks=VoteMarks(
        agreement.job, rank=rank, world_size=world_size))
    cleanups.add(channel.close)  # its marks' beat (the layer manager's close stops it too)
    manager = LayerManager(
        {s.index: s.blocks for s in pipeline.stages if s.blocks is not None}, placement=placement,
        stage_ranks=pipeline.stage_ranks, optimizer=optimizer,
        factory=hoisting_factory(norms.factory(config.layer_factory) if norms else config.layer_factory,
                                 hoisted),
        specs=config.specs,
        messenger=ControlMessenger(session.plane, pipeline.rank), channel=channel, device=pipeline.device,
        timeout_s=config.migration_timeout_s, faults=settings.faults.migration_faults(rank), shared=shared,
        listeners=listeners, carry=carried)
    cleanups.add(manager.close)
    return manager
