"""``vpipe.attach``: the one line that puts vpipe underneath an existing pipeline trainer.

It takes the trainer's own objects and changes none of them structurally: a
``torch.distributed.pipelining`` schedule (one stage per rank, or several: Interleaved
1F1B, LoopedBFS, the zero-bubble schedules), vpipe's ``SchedulePipeDream``, DeepSpeed's
``PipelineEngine``, or a plain stage module for a hand-written loop. ``schedule.step`` (the
engine's ``train_batch``) is wrapped as an instance attribute, torch's stages get their
chunk methods wrapped by the tensor managers, the blocks get hooks and their containers
are edited in place when layers migrate; ``stage.submod`` and its ``forward`` are never
replaced. ``detach()`` removes every hook and wrapper; layers that moved stay where they are.

This module is the trainer's handle on the rank's parts; :mod:`vpipe.rank.build` builds them, all or
nothing (a failed attach leaves the trainer's objects as they were), and the undos it registered are the
detach (see :mod:`vpipe.rank` for each part's job). Its name is private so that ``vpipe.attach`` is only
ever the function: a public submodule of that name would replace it.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from vpipe.config import AUTO_BUDGET, VpipeConfig
from vpipe.engines import Engine
from vpipe.plan import Plan, PlanError
from vpipe.planner import DEFAULT_PLANNER
from vpipe.rank.build import build_rank
from vpipe.rank.environment import check_environment
from vpipe.rank.resolved import resolve_memory_budget
from vpipe.rank.state import restore_vpipe_state, vpipe_state
from vpipe.settings import Settings
from vpipe.stage.pipeline import AttachTarget
from vpipe.tensor_manager import TensorManager

# one optimizer over the rank's stages, or one per stage module: a
# list, or a container holding ``.optimizers``
OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None

__all__ = ["attach", "Vpipe", "VpipeConfig", "AUTO_BUDGET", "DEFAULT_PLANNER", "resolve_memory_budget"]


def attach(target: AttachTarget, *, optimizer: OptimizerArg = None, config: VpipeConfig | None = None,
           store: Store | None = None, **options: Any) -> Vpipe:
    """Turn vpipe on for this rank's stages. Every rank of the run must call it (it is collective).

    ``target`` is the trainer's schedule, DeepSpeed engine or stage module; ``optimizer`` the
    optimizer of this rank's stages (a PipeDream schedule and a DeepSpeed engine bring their own), or
    one optimizer per stage module in a list or a container holding them as ``.optimizers``
    (torchtitan's); ``options`` override :class:`VpipeConfig` fields. ``store`` is the run's c10d
    store (default: the one ``torch.distributed`` was initialised with).
    """
    if config is not None and options:
        raise TypeError("pass either config= or keyword options, not both")
    # every VPIPE_* variable, read once per process, checked here and handed on
    settings = check_environment()
    config = config or VpipeConfig.from_settings(settings, **options)
    return Vpipe(target, optimizer=optimizer, config=config, store=store, settings=settings)


class Vpipe:
    """vpipe on one rank: tensor managers, monitors + control session, layer manager, plan application."""

    def __init__(self, target: AttachTarget, *, optimizer: OptimizerArg, config: VpipeConfig,
                 store: Store | None = None, settings: Settings | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("vpipe.attach needs torch.distributed initialised first "
                               "(torchrun or vpipe train)")
        self.config = config
        self.settings = settings if settings is not None else check_environment()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # in the world (logs, files)
        # all or nothing: a step that fails undoes every one before it,
        # and the trainer's objects are as they were
        built = build_rank(target, optimizer=optimizer, config=config, store=store, settings=self.settings,
                           rank=self.rank, world_size=self.world_size)
        self._cleanups = built.cleanups  # the detach: every undo, registered as its part was made
        self._detached = False
        self.engine: Engine = built.engine  # what differs between the engines vpipe runs under
        self.pipeline = built.pipeline
        self.optimizer = built.optimizer  # several optimizers (per model part, or per stage) read as one
        self.stage_index, self.num_stages = self.pipeline.first.index, self.pipeline.num_stages
        # peers by rank in the pipeline's group
        self.replicas, self.pipe_rank = built.replicas, self.pipeline.rank
        self.agreement, self.keys = built.agreement, built.keys
        self.norms, self.carried, self.move_refusal = built.norms, built.carried, built.move_refusal
        self.memory_budget, self.memories = built.memory_budget, built.memories
        self.stage_handles, self.tensor_managers = built.stage_handles, built.tensor_managers
        self.session, self.layer_manager = built.session, built.layer_manager
        self.plan_in_force = built.plan_in_force  # the one owner of the plan in force
        self._parts, self.boundary, self.driver, self.edits = (built.parts, built.boundary, built.driver,
                                                               built.edits)
        atexit.register(self._at_exit)  # a script that never calls detach() still shuts vpipe down cleanly

    @property
    def _local(self) -> list[int]:
        return [s.index for s in self.pipeline.stages]

    # ------------------------------------------------------------------ what the trainer calls
    def request_plan(self, plan: Plan, at_step: int) -> None:
        """Apply ``plan`` before step ``at_step`` (forced moves; every rank must call it identically)."""
        self.plan_in_force.check(plan, self.plan_in_force.order, self.num_stages)
        refusal = self.engine.plan_refusal(self.plan_in_force.placement, plan.stages)
        if refusal is not None:
            raise PlanError(refusal)
        self.boundary.request(plan, at_step, self.driver.iteration)

    def add_layers(self, position: int, specs: list[Any]) -> list[int]:
        """Insert layers before model position ``position`` (every
        rank calls it at the same step boundary)."""
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
        """vpipe's part of a checkpoint (plain JSON values): plan
        epoch, step, placement, policies, next layer id. A stream is flushed first: what it holds in
        flight (micro-batches, a period's gradient, stashed weight versions) is in no checkpoint."""
        unsettled = self.engine.unsettled()
        if unsettled is not None:
            raise RuntimeError(f"a checkpoint on {unsettled}")
        return vpipe_state(self._parts, self.driver.iteration)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's vpipe state (every rank
        calls it with the same state, before a step)."""
        restore_vpipe_state(state, self._parts, driver=self.driver, hand_written=self.engine.hand_written,
                            who=self.stage_index)

    def fixed_bytes(self) -> int:
        """Bytes this rank's stages hold whatever their activation
        policies (weights, gradients, optimizer state)."""
        return sum(memory.fixed_bytes() for memory in self.memories.values())

    def memory_report(self) -> dict[str, Any]:
        """This rank's memory as vpipe accounts it: budget, fixed bytes, peak saved activations, policies."""
        peak = sum(tm.ledger.peak for tm in self.tensor_managers.values())
        fixed = self.fixed_bytes()
        policies = {str(lid): p.value for tm in self.tensor_managers.values()
                    for lid, p in tm.policies().items()}
        return {"budget_bytes": self.memory_budget, "fixed_bytes": fixed, "peak_saved_bytes": peak,
                "footprint_bytes": fixed + peak, "policies": policies}

    # ------------------------------------------------------------------ the end
    def _at_exit(self) -> None:
        # after an uncaught exception the peers' last stats may never come: no wait for them
        if not self._detached:
            self._cleanups.wait_s = 0.0 if getattr(sys, "last_value", None) is not None else 5.0
            self.detach()

    def detach(self) -> None:
        """Remove every hook and wrapper vpipe installed, and this rank's store keys (the current placement
        stays): the undos the attach registered as it made each part, newest first."""
        if self._detached:
            return
        self._detached = True
        atexit.unregister(self._at_exit)
        errors = self._cleanups.run()
        if errors:
            raise RuntimeError(f"vpipe.detach could not undo everything: {errors[0]}") from errors[0]
