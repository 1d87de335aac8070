"""``vpipe.attach``: the one line that puts vpipe underneath an existing pipeline trainer.

It takes the trainer's own objects and changes none of them structurally:

- a ``torch.distributed.pipelining`` single-stage schedule (``ScheduleGPipe``,
  ``Schedule1F1B``) or vpipe's ``SchedulePipeDream``: ``schedule.step`` is wrapped as an
  instance attribute (plans are applied before a step starts, i.e. after the user's
  ``optimizer.step()``, and the step is monitored), the stage's chunk methods are wrapped
  by the tensor manager, the stage's blocks get hooks and their container is edited in
  place when layers migrate — ``stage.submod`` and its ``forward`` are never replaced;
- a plain stage module (a hand-written GPipe loop): micro-batches are counted by the
  module's forward calls, and the step boundary is the optimizer's ``step()`` (a post-hook).

The stage module is whatever the trainer built: vpipe finds its run of repeated blocks
(:mod:`vpipe.migration.blocks`; ``layers=`` names it where that is ambiguous), agrees on
global layer ids with the other stages, and moves only those blocks. ``detach()`` removes
every hook and wrapper; layers that moved stay where they are.

Plans reach the stages at different times (they travel stage by stage). All ranks must
apply a plan at the same step, so stage 0 (the last to receive it) decides the step and
writes it to the rendezvous store; a stage holding a pending plan reads that key at each
step boundary. Causality makes this exact: stage k cannot start step ``t`` before stage
0's forwards of step ``t-1``, which stage 0 starts only after writing the key.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vpipe.log import decision, step_record
from vpipe.migration.blocks import (BlockContainerError, ContainerLayout, StageBlocks, agree_key_style, block_kind,
                                    find_block_container, global_ids, layout_of)
from vpipe.planner.plan import Plan, PlanError, Policy
from vpipe.sizes import parse_bytes

log = logging.getLogger("vpipe.attach")

__all__ = ["attach", "Vpipe", "VpipeConfig"]

_APPLY_KEY = "apply/{}"
_LAYERS_KEY = "layers/{}"
# every attach gets keys of its own: attach is collective, so every rank counts its attaches alike, and an
# attach after a detach never reads the previous one's keys (plan epochs start again at 0)
_ATTACHES = itertools.count()
DEFAULT_PLANNER = "vpipe.planner.online:srp"


AUTO_BUDGET = "auto"
_DEVICE_MARGIN = 0.08  # of a GPU's memory left to the CUDA context, the allocator's cache and fragmentation
_DEVICE_MARGIN_MIN = 1 << 30


def resolve_memory_budget(budget: int | str | None, device: torch.device) -> int | None:
    """Bytes for ``budget``: "auto" is the GPU's capacity minus a margin; a CPU stage has no device limit."""
    if budget != AUTO_BUDGET:
        return budget  # type: ignore[return-value]
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return total - max(_DEVICE_MARGIN_MIN, int(total * _DEVICE_MARGIN))


@dataclass
class VpipeConfig:
    """What vpipe does underneath the trainer. Every field is validated when attaching."""

    # bytes per stage: parameters, gradients, optimizer state, saved activations; "auto": the GPU's
    # capacity minus a margin (on CPU: no budget); None: no budget
    memory_budget: int | str | None = AUTO_BUDGET
    planning: bool = True  # run the planner daemon and apply its plans
    planner: str = DEFAULT_PLANNER  # the daemon's planner function (module:function)
    sample_every: int = 10  # monitor every k-th step
    layers: str | None = None  # dotted path of the block container in the stage module (default: found)
    layer_factory: Callable[[int, Any], nn.Module] | None = None  # builds a layer by (id, spec); default: clone one
    specs: Mapping[int, Any] | None = None  # layer id -> spec handed to the factory (plain msgpack-able values)
    policies: Mapping[int, Policy | str] | None = None  # initial keep/swap/recompute per layer (default keep)
    tensor_manager: bool = True
    min_swap_bytes: int | None = None
    host_pool_bytes: int | None = None
    migration_timeout_s: float = field(default_factory=lambda: _env_seconds("VPIPE_MIGRATION_TIMEOUT", 30.0))
    # how long attach (and a layer edit) waits for every rank to make the same call
    agree_timeout_s: float = field(default_factory=lambda: _env_seconds("VPIPE_AGREE_TIMEOUT", 120.0))
    apply_lag_steps: int = 2  # stage 0 schedules a plan this many steps after it has it
    micro_batches: int | None = None  # per step of a hand-written loop (the planner models the pipeline with it)
    planner_options: dict[str, Any] = field(default_factory=dict)  # extra OnlineConfig fields
    # JSON lines of every decision; default: $VPIPE_LOG_FILE, so a one-line attach can be logged from outside
    log_file: str | None = field(default_factory=lambda: os.environ.get("VPIPE_LOG_FILE") or None)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"vpipe config: {message}")

        if isinstance(self.memory_budget, str) and self.memory_budget != AUTO_BUDGET:
            try:  # "16GB", "15GiB", "16e9": read as everywhere else in vpipe
                self.memory_budget = parse_bytes(self.memory_budget, what="memory_budget")
            except ValueError as e:
                raise ValueError(f"vpipe config: {e}") from None

        need(self.memory_budget is None or self.memory_budget == AUTO_BUDGET
             or (isinstance(self.memory_budget, int) and not isinstance(self.memory_budget, bool)
                 and self.memory_budget > 0),
             f"memory_budget must be a positive number of bytes, 'auto' or None, got {self.memory_budget!r}")
        need(isinstance(self.sample_every, int) and self.sample_every >= 1,
             f"sample_every must be a positive integer, got {self.sample_every!r}")
        need(isinstance(self.planner, str) and ":" in self.planner,
             f"planner must be 'module:function', got {self.planner!r}")
        need(self.layer_factory is None or callable(self.layer_factory), "layer_factory must be callable")
        need(self.layers is None or (isinstance(self.layers, str) and bool(self.layers.strip())),
             f"layers must be the dotted path of the block container (e.g. 'layers'), got {self.layers!r}")
        need(math.isfinite(self.migration_timeout_s) and self.migration_timeout_s > 0,
             f"migration_timeout_s must be positive, got {self.migration_timeout_s!r}")
        need(math.isfinite(self.agree_timeout_s) and self.agree_timeout_s > 0,
             f"agree_timeout_s must be positive, got {self.agree_timeout_s!r}")
        need(isinstance(self.apply_lag_steps, int) and self.apply_lag_steps >= 1,
             f"apply_lag_steps must be >= 1, got {self.apply_lag_steps!r}")
        for lid, pol in (self.policies or {}).items():
            Policy.parse(pol.value if isinstance(pol, Policy) else pol)
        need(self.min_swap_bytes is None or self.min_swap_bytes >= 0, "min_swap_bytes must be >= 0")
        need(self.micro_batches is None or (isinstance(self.micro_batches, int) and self.micro_batches >= 1),
             f"micro_batches must be a positive integer or None, got {self.micro_batches!r}")
        need(self.host_pool_bytes is None or self.host_pool_bytes > 0, "host_pool_bytes must be positive")


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None


def attach(target: Any, *, optimizer: torch.optim.Optimizer | None = None, config: VpipeConfig | None = None,
           store: Any = None, **options: Any) -> Vpipe:
    """Turn vpipe on for this rank's stage. Every rank of the run must call it (it is collective).

    ``target`` is the trainer's schedule or its stage module; ``optimizer`` the stage's
    optimizer (a PipeDream schedule brings its own); ``options`` override
    :class:`VpipeConfig` fields. ``store`` is the run's c10d store (default: the one
    ``torch.distributed`` was initialised with).
    """
    if config is not None and options:
        raise TypeError("pass either config= or keyword options, not both")
    config = config or VpipeConfig(**options)
    return Vpipe(target, optimizer=optimizer, config=config, store=store)


class Vpipe:
    """vpipe on one rank: tensor manager, monitor + control session, layer manager, plan application."""

    def __init__(self, target: Any, *, optimizer: torch.optim.Optimizer | None, config: VpipeConfig,
                 store: Any = None) -> None:
        from vpipe.runtime.pipedream import SchedulePipeDream

        if not dist.is_initialized():
            raise RuntimeError("vpipe.attach needs torch.distributed initialised first (torchrun or vpipe train)")
        self.config = config
        if config.log_file is not None:
            from vpipe import log as run_log

            run_log.configure(config.log_file, rank=dist.get_rank())
        self.schedule, self.stage, self.module = _unpack_target(target)
        self.pipedream = isinstance(self.schedule, SchedulePipeDream)
        if self.pipedream and optimizer is None:
            optimizer = self.schedule.optimizer
        self.optimizer = optimizer
        _check_optimizer(optimizer, self.module)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.stage_index = self.stage.stage_index if self.stage is not None else self.rank
        self.num_stages = self.stage.num_stages if self.stage is not None else self.world_size
        self.device = torch.device(self.stage.device) if self.stage is not None else _module_device(self.module)
        self.memory_budget = resolve_memory_budget(config.memory_budget, self.device)
        self.namespace = f"vpipe/attach-{next(_ATTACHES)}/"
        self.store = dist.PrefixStore(self.namespace, store if store is not None else _default_store())
        self._written: list[str] = []  # this rank's keys, deleted at detach
        self.iteration = 0
        self.boundary_s: list[float] = []  # seconds spent applying plans before each step (the move stall)
        self._boundary_at: float | None = None  # when the previous step boundary began
        self._forced: dict[int, list[Plan]] = {}
        self._pending: dict[int, Plan] = {}
        self._undo: list[Callable[[], None]] = []
        self._detached = False
        _check_group(self.stage, self.world_size)
        self.blocks, self.placement = self._exchange_placement()
        self.move_refusal = self._move_refusal()
        initial = Plan(epoch=0, stages=self.placement,
                       policies={lid: Policy.parse(p.value if isinstance(p, Policy) else p)
                                 for lid, p in (config.policies or {}).items()})
        layers = self.blocks.blocks()
        self._agree_run_secret()
        self.tensor_manager = self._start_tensor_manager(layers, initial) if config.tensor_manager else None
        self.session = self._start_session(layers, initial)
        self.layer_manager = self._start_layer_manager()
        self._install()
        atexit.register(self._at_exit)  # a script that never calls detach() still shuts vpipe down cleanly
        decision("attached", f"vpipe attached to stage {self.stage_index} of {self.num_stages}",
                 stage=self.stage_index, layers=list(self.placement[self.stage_index]),
                 schedule=type(self.schedule).__name__ if self.schedule is not None else "module",
                 memory_budget=self.memory_budget, planning=config.planning,
                 container=self.blocks.path or "<stage module>", keys=self.blocks.style.value)
        if self.move_refusal is not None:
            decision("moves_off", f"stage {self.stage_index}: layers will not move ({self.move_refusal}); "
                     "swap and recompute plans still apply", stage=self.stage_index, reason=self.move_refusal)

    # ------------------------------------------------------------------ set-up
    def _exchange_placement(self) -> tuple[StageBlocks, tuple[tuple[int, ...], ...]]:
        """Find this stage's blocks, tell the other stages how they are keyed, agree on global ids."""
        try:
            path, container = find_block_container(self.module, self.config.layers)
            mine = {"path": path, "kind": type(container).__name__, "keys": list(container._modules)}
        except BlockContainerError as e:
            mine = {"error": str(e)}
        self._set(_LAYERS_KEY.format(self.stage_index), json.dumps(mine))
        found = [json.loads(raw) for raw in self._gather(_LAYERS_KEY, "vpipe.attach")]
        if "error" in mine:
            raise BlockContainerError(f"stage {self.stage_index}: {mine['error']}")
        failed = [s for s, f in enumerate(found) if "error" in f]
        if failed:
            raise BlockContainerError(f"stage(s) {failed} could not find their blocks (their error says why); "
                                      f"this stage found {path or '<the stage module>'}")
        layouts = [ContainerLayout(f["path"], f["kind"], tuple(f["keys"])) for f in found]
        style = agree_key_style(layouts)
        stages = tuple(tuple(ids) for ids in global_ids(layouts, style))
        blocks = StageBlocks(container, stages[self.stage_index], style, path)
        assert layout_of(path, container).keys == layouts[self.stage_index].keys
        return blocks, stages

    def _gather(self, key: str, call: str) -> list[bytes]:
        """Every stage's value of ``key`` (a pattern with the stage index), once all have written it.

        A stage that never makes the same call (an attach or an edit on some ranks only) ends
        the wait after ``agree_timeout_s`` with an error naming it, instead of a hang.
        """
        keys = [key.format(s) for s in range(self.num_stages)]
        deadline = time.monotonic() + self.config.agree_timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [s for s, k in enumerate(keys) if not self.store.check([k])]
                raise RuntimeError(f"{call} on stage {self.stage_index}: stage(s) {missing} did not make the same "
                                   f"call within {self.config.agree_timeout_s:.0f} s; every rank must call it, "
                                   "at the same step")
            time.sleep(0.01)
        return self.store.multi_get(keys)

    def _agree_run_secret(self) -> None:
        """This run's control-plane key when the launcher made none (torchrun): stage 0 makes it, the others
        read it from the store. It goes into the environment, so the planner daemon inherits it."""
        from vpipe.control.curve import RUN_SECRET_ENV, configured_by_files, has_run_secret, new_run_secret

        if configured_by_files() or has_run_secret():
            return
        if self.stage_index == 0:
            self._set("ctl/run-secret", new_run_secret() or "")
        deadline = time.monotonic() + self.config.agree_timeout_s
        while not self.store.check(["ctl/run-secret"]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"vpipe.attach on stage {self.stage_index}: stage 0 did not make the same call "
                                   f"within {self.config.agree_timeout_s:.0f} s; every rank must call it")
            time.sleep(0.01)
        secret = self.store.get("ctl/run-secret").decode("ascii")
        if secret:
            os.environ[RUN_SECRET_ENV] = secret

    def _move_refusal(self) -> str | None:
        """Why this stage's layers cannot move, or None when they can."""
        if isinstance(self.module, torch.fx.GraphModule):
            return "the stage is a traced GraphModule (pipeline() split): its forward is a fixed graph of modules"
        if self.pipedream and (self.blocks.path or self.blocks.style.value != "ids"):
            return ("a PipeDream stream moves layers only in a stage module that is an nn.Sequential named by "
                    "global layer id")
        return None

    def _start_tensor_manager(self, layers: dict[int, nn.Module], initial: Plan) -> Any:
        from vpipe.tensor_manager import TensorManager, install_on_stage

        kwargs: dict[str, Any] = {"device": self.device, "budget_bytes": self._activation_budget(),
                                  "policies": {lid: initial.policy(lid) for lid in layers}}
        if self.config.min_swap_bytes is not None:
            kwargs["min_swap_bytes"] = self.config.min_swap_bytes
        if self.config.host_pool_bytes is not None:
            kwargs["host_pool_bytes"] = self.config.host_pool_bytes
        manager = TensorManager(layers, **kwargs)
        if self.stage is not None:
            handle = install_on_stage(self.stage, manager)
            self._undo.append(handle.remove)
        else:
            self._counter = _MicroBatchCounter(self.module, manager)
            self._undo.append(self._counter.remove)
        self._undo.append(manager.close)
        return manager

    def _activation_budget(self) -> int | None:
        """The budget left for saved activations once the stage's fixed bytes are paid (see :meth:`fixed_bytes`)."""
        budget = self.memory_budget
        if budget is None:
            return None
        fixed = self.fixed_bytes()
        if fixed >= budget:
            from vpipe.tensor_manager import MemoryBudgetError

            raise MemoryBudgetError(f"stage {self.stage_index}: parameters, gradients, optimizer state and stashed "
                                    f"weight versions take {fixed} bytes, the memory budget is {budget} bytes")
        return budget - fixed

    def fixed_bytes(self) -> int:
        """Bytes this stage holds whatever the activation policies: weights, gradients, optimizer state and,
        under PipeDream, the extra weight versions stashed for in-flight micro-batches.

        Optimizer state appears at the first ``step()``: until then it is counted as the
        optimizer will make it (Adam-like: two moments, momentum SGD: one), so that step 0
        gets no more room for activations than the steps after it.
        """
        from vpipe.tensor_manager.budget import expected_state_factor, stage_fixed_bytes

        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        state = 0
        if self.optimizer is not None:
            state = sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                        for t in st.values() if isinstance(t, torch.Tensor))
            state = state or expected_state_factor(self.optimizer) * params
        versions = 1
        if self.pipedream:
            versions = self.num_stages if getattr(self.schedule, "vertical_sync", False) else \
                self.num_stages - self.stage_index
        return stage_fixed_bytes(params, state, versions)

    def _start_session(self, layers: dict[int, nn.Module], initial: Plan) -> Any:
        from vpipe.control.session import ControlOptions, ControlSession
        from vpipe.monitors.source import TensorManagerSource
        from vpipe.planner.online import CONFIG_ENV, OnlineConfig

        if self.config.planning and self.schedule is None and self.config.micro_batches is None:
            log.warning("vpipe.attach(module): micro_batches= not given, the planner assumes 1 micro-batch per step "
                        "(a pipeline that then never overlaps stages, so it will not rebalance)")
        if self.config.planning and self.stage_index == self.num_stages - 1:
            online = OnlineConfig(schedule=self._schedule_name(), micro_batches=self._micro_batches(),
                                  memory_budget=self.memory_budget,
                                  allow_moves=self.move_refusal is None, **self.config.planner_options)
            os.environ[CONFIG_ENV] = online.to_env()  # the daemon this stage starts inherits it
        options = ControlOptions(sample_every=self.config.sample_every,
                                 planner=self.config.planner if self.config.planning else None,
                                 log_file=self.config.log_file)
        session = ControlSession(layers, stage_index=self.stage_index, num_stages=self.num_stages, store=self.store,
                                 rank=self.rank, world_size=self.world_size, device=self.device,
                                 optimizer=self.optimizer, plan=initial,
                                 saved_source=TensorManagerSource(self.tensor_manager) if self.tensor_manager else None,
                                 options=options, pipeline_stage=self.stage)
        self._undo.append(lambda: session.close(self._exit_timeout_s))
        return session

    def _start_layer_manager(self) -> Any:
        from vpipe.migration.layer_manager import LayerManager
        from vpipe.migration.messages import ControlMessenger
        from vpipe.migration.transfer import TransferChannel

        manager = LayerManager(
            self.blocks, stage_index=self.stage_index, placement=self.placement, optimizer=self.optimizer,
            factory=self.config.layer_factory, specs=self.config.specs, messenger=ControlMessenger(self.session.plane, self.stage_index),
            channel=TransferChannel(self.device), device=self.device, timeout_s=self.config.migration_timeout_s,
        )
        monitor = self.session.monitor
        manager.listeners.append(monitor)
        monitor.layer_order = lambda: manager.layer_ids
        monitor.layer_kind = block_kind
        monitor.builds = manager.can_build
        if self.blocks.path:  # modules outside the blocks: their cost is the stage's, wherever the blocks go
            monitor.watch_stage(self.module)
        if self.tensor_manager is not None:
            manager.listeners.append(self.tensor_manager)
        self._undo.append(manager.close)
        return manager

    def _install(self) -> None:
        if self.schedule is not None:
            original = self.schedule.step

            def step(*args: Any, **kwargs: Any) -> Any:
                return self._step(original, *args, **kwargs)

            self.schedule.step = step  # instance attribute over the class method
            self._undo.append(lambda: self.schedule.__dict__.pop("step", None))
        else:
            if self.optimizer is None:
                raise ValueError("attaching to a stage module needs optimizer=: its step() marks the step boundary")
            self._begin_step()
            handle = self.optimizer.register_step_post_hook(lambda *_: self._module_step_done())
            self._undo.append(handle.remove)

    def _schedule_name(self) -> str:
        from torch.distributed.pipelining import Schedule1F1B

        if self.pipedream:
            return "pipedream"
        return "1f1b" if isinstance(self.schedule, Schedule1F1B) else "gpipe"

    def _micro_batches(self) -> int:
        if self.schedule is not None:
            return int(getattr(self.schedule, "_n_microbatches", 1))
        return self.config.micro_batches or 1

    # ------------------------------------------------------------------ the step
    _in_step = False
    _edits = 0
    _budget_key: tuple[int, int] | None = None

    def _begin_step(self) -> None:
        self.session.begin_step(self.iteration)
        if self.tensor_manager is not None:  # the monitor reads saved bytes on its sampled steps only
            self.tensor_manager.metering = self.session.monitor.is_sampled(self.iteration)

    def _step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._boundary()
        self._begin_step()
        self._in_step = True
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            self.session.monitor.abort_iteration()
            own = _own_error(exc)
            if own is not None:  # torch wraps it in "[Stage k] failed to run forward": say what vpipe found
                raise own from None
            raise
        finally:
            self._in_step = False
        self._received(self.session.end_step())
        self.iteration += 1
        return result

    _counter: _MicroBatchCounter | None = None

    def _module_step_done(self) -> None:
        if self._counter is not None:
            self._counter.reset()
        if self.tensor_manager is not None:
            self.tensor_manager.end_of_step()  # a hand-written loop tells the manager of no backward
        self._received(self.session.end_step())
        self.iteration += 1
        self._boundary()
        self._begin_step()

    def _received(self, plans: list[Plan]) -> None:
        for plan in plans:
            if plan.epoch <= self.layer_manager.epoch or plan.epoch in self._pending:
                continue
            self._pending[plan.epoch] = plan
            if self.stage_index == 0:
                # the plan has reached every stage: schedule it for all of them
                # a PipeDream stream does not flush, so a stage may finish step t+1 before stage 0 ends
                # step t: one step more makes the key visible everywhere by the boundary that registers it
                at = self.iteration + self.config.apply_lag_steps + (1 if self.pipedream else 0)
                self._set(_APPLY_KEY.format(plan.epoch), str(at))
                decision("plan_scheduled", f"epoch {plan.epoch} will apply before step {at}",
                         epoch=plan.epoch, step=at)

    @property
    def _applying_step(self) -> int:
        """The step whose start the plans applied now take effect at.

        Flush schedules move layers at this boundary. A PipeDream stream registers a move
        one step ahead and switches at the first micro-batch of the next step, so that both
        stages of a move are still holding every weight version the switch needs.
        """
        return self.iteration + 1 if self.pipedream else self.iteration

    def _due_plans(self) -> list[Plan]:
        now = self._applying_step
        due = list(self._forced.pop(now, []))
        for epoch in sorted(self._pending):
            key = _APPLY_KEY.format(epoch)
            if not self.store.check([key]):
                continue
            at = int(self.store.get(key))
            if at > now:
                continue
            if at < now:
                raise RuntimeError(f"stage {self.stage_index}: plan epoch {epoch} was due at step {at} "
                                   f"but this stage only saw the decision at step {now}")
            due.append(self._pending.pop(epoch))
        return due

    def _boundary(self) -> None:
        started = time.perf_counter()
        if self._boundary_at is not None and self.stage_index == self.num_stages - 1:
            step_record(self.iteration - 1, started - self._boundary_at, stage=self.stage_index,
                        micro_batches=self._micro_batches(), layers=len(self.layer_manager.layer_ids))
        self._boundary_at = started
        for plan in self._due_plans():
            self._apply(plan)
        if self.tensor_manager is not None and self.memory_budget is not None:
            # the optimizer state appears at the first step, and layers come and go with plans and edits
            key = (self.layer_manager.epoch, len(self.optimizer.state) if self.optimizer is not None else 0)
            if key != self._budget_key:
                self._budget_key = key
                self.tensor_manager.budget_bytes = self._activation_budget()
        self._continue_streamed()
        self.boundary_s.append(time.perf_counter() - started)

    # ------------------------------------------------------------------ applying plans
    def request_plan(self, plan: Plan, at_step: int) -> None:
        """Apply ``plan`` before step ``at_step`` (forced moves; every rank must call it identically)."""
        if at_step < self._applying_step:
            raise ValueError(f"step {at_step} is too early: this rank applies plans from step {self._applying_step} on")
        plan.check_against(self.layer_manager.order, self.num_stages)
        self._forced.setdefault(at_step, []).append(plan)

    def _apply(self, plan: Plan) -> None:
        from vpipe.migration.rebuild import reset_shape_inference

        lm = self.layer_manager
        if plan.epoch <= lm.epoch:
            log.info("stage %d: skipping stale plan epoch %d", self.stage_index, plan.epoch)
            return
        if sorted(plan.layer_ids) != sorted(lm.order):
            decision("plan_skipped", f"epoch {plan.epoch}: made for another set of layers (they were edited since)",
                     epoch=plan.epoch, stage=self.stage_index)
            return
        try:  # every rank holds the same order, so every rank skips the same plans
            plan.check_against(lm.order, self.num_stages)
        except PlanError as e:
            decision("plan_skipped", f"epoch {plan.epoch}: {e}", epoch=plan.epoch, stage=self.stage_index)
            return
        if self.tensor_manager is not None:
            self.tensor_manager.set_policies({lid: plan.policy(lid) for lid in lm.layer_ids})
        moves = [list(s) for s in plan.stages] != [list(s) for s in lm.placement]
        if moves and self.move_refusal is not None:
            decision("plan_skipped", f"epoch {plan.epoch}: layers cannot move ({self.move_refusal}); "
                     "applied policies only", epoch=plan.epoch, stage=self.stage_index)
            lm.epoch = plan.epoch
        elif moves and self.pipedream:
            lm.start_streamed(plan, self.schedule, switch_mb=self._applying_step * self._micro_batches())
            if [list(s) for s in lm.placement] != [list(s) for s in plan.stages]:
                self._streamed_rest = plan  # a two-hop move: its next round follows when this one is done
        elif moves:
            report = lm.apply(plan)
            if report.rebuilt and self.schedule is not None:
                reset_shape_inference(self.schedule)
        else:
            lm.epoch = plan.epoch
        if self.tensor_manager is not None:
            self.tensor_manager.set_policies({lid: plan.policy(lid) for lid in lm.layer_ids})
            self.tensor_manager.budget_bytes = self._activation_budget()
        self.session.agent.plan = Plan(epoch=plan.epoch, stages=lm.placement, policies=plan.policies,
                                       predicted_step_s=plan.predicted_step_s, reason=plan.reason)
        self.placement = lm.placement
        self.session.monitor.epoch = plan.epoch
        decision("plan_applied", f"epoch {plan.epoch} takes effect at step {self._applying_step}", epoch=plan.epoch,
                 stage=self.stage_index, step=self._applying_step, layers=lm.layer_ids,
                 policies={str(lid): plan.policy(lid).value for lid in lm.layer_ids})

    _streamed_rest: Plan | None = None

    def _continue_streamed(self) -> None:
        plan = self._streamed_rest
        if plan is None or any(not m.done for m in self.schedule.movers):
            return
        self._streamed_rest = None
        self.layer_manager.start_streamed(plan, self.schedule, switch_mb=(self.iteration + 1) * self._micro_batches(),
                                          continuation=True)
        if [list(s) for s in self.layer_manager.placement] != [list(s) for s in plan.stages]:
            self._streamed_rest = plan
        self.placement = self.layer_manager.placement

    # ------------------------------------------------------------------ NAS
    def add_layers(self, position: int, specs: list[Any]) -> list[int]:
        """Insert layers before model position ``position`` (every rank calls it at the same step boundary)."""
        self._require_boundary("add_layers")
        if self.config.layer_factory is None:
            raise RuntimeError("add_layers needs layer_factory= in the vpipe config to build the new layers")
        self._agree_edit({"call": "add_layers", "position": position, "count": len(specs)})
        new_ids = self.layer_manager.add_layers(position, specs)
        self._after_edit()
        return new_ids

    def remove_layers(self, layer_ids: list[int]) -> None:
        """Remove layers by id (every rank calls it at the same step boundary)."""
        self._require_boundary("remove_layers")
        self._agree_edit({"call": "remove_layers", "layers": sorted(int(lid) for lid in layer_ids)})
        self.layer_manager.remove_layers(layer_ids)
        self._after_edit()

    def _agree_edit(self, edit: dict[str, Any]) -> None:
        """Every rank makes the same layer edit, or every rank learns which did not (before anything changes)."""
        self._edits += 1
        key = f"edit/{self._edits}/{{}}"
        self._set(key.format(self.stage_index), json.dumps(edit, sort_keys=True))
        seen = [json.loads(raw) for raw in self._gather(key, edit["call"])]
        differ = [s for s, other in enumerate(seen) if other != edit]
        if differ:
            raise RuntimeError(f"{edit['call']} on stage {self.stage_index}: stage(s) {differ} made another layer "
                               f"edit at this point ({seen[differ[0]]} vs {edit}); every rank must make the same one")

    def _require_boundary(self, what: str) -> None:
        if self._in_step or (self._counter is not None and self._counter.next_mb > 0):
            raise RuntimeError(f"{what} must be called between steps (after optimizer.step()), not inside one")
        if self.pipedream and self.schedule.in_flight:
            raise RuntimeError(f"{what} on a PipeDream stream needs schedule.flush() first "
                               f"({len(self.schedule.in_flight)} micro-batches in flight)")
        if isinstance(self.module, torch.fx.GraphModule):
            raise RuntimeError(f"{what} cannot edit a traced GraphModule stage (its forward is a fixed graph)")

    def _after_edit(self) -> None:
        from vpipe.migration.rebuild import reset_shape_inference

        # a new epoch: plans made for the old layers become stale, stats say which layers they measured
        self.layer_manager.epoch += 1
        self.session.monitor.epoch = self.layer_manager.epoch
        self.placement = self.layer_manager.placement
        self.session.agent.plan = Plan(epoch=self.layer_manager.epoch, stages=self.placement,
                                       policies={lid: p for lid, p in (self.session.agent.plan.policies.items()
                                                                       if self.session.agent.plan else [])
                                                 if lid in self.layer_manager.order})
        if self.schedule is not None:
            reset_shape_inference(self.schedule)  # new layers have never run: redo shape inference everywhere
        if self.tensor_manager is not None:
            self.tensor_manager.budget_bytes = self._activation_budget()

    # ------------------------------------------------------------------ status
    @property
    def layer_ids(self) -> list[int]:
        return self.layer_manager.layer_ids

    def state(self) -> dict[str, Any]:
        return {"epoch": self.layer_manager.epoch, "stages": [list(s) for s in self.layer_manager.placement],
                "iteration": self.iteration}

    def state_dict(self) -> dict[str, Any]:
        """vpipe's part of a checkpoint (plain JSON values): plan epoch, step, placement, policies, next layer id.

        Policies are this rank's own layers' (what its tensor manager runs now) over the
        last applied plan's; :func:`vpipe.checkpoint.save_checkpoint` merges the ranks'.
        """
        from vpipe.checkpoint import VERSION

        lm = self.layer_manager
        plan = self.session.agent.plan
        policies = {lid: p.value for lid, p in (plan.policies.items() if plan is not None else [])}
        if self.tensor_manager is not None:
            policies.update({lid: p.value for lid, p in self.tensor_manager.policies().items()})
        return {"version": VERSION, "epoch": lm.epoch, "iteration": self.iteration,
                "stages": [list(s) for s in lm.placement],
                "policies": {str(lid): p for lid, p in sorted(policies.items()) if lid in lm.order},
                "next_layer_id": max(lm._next_id, max(lm.order) + 1)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's vpipe state (every rank calls it with the same state, before a step).

        The layers must already be where this run placed them (the same layer set; the
        placement may differ, e.g. on another number of stages). Restores the plan epoch
        (so older plans stay stale), the step counter (forced moves name absolute steps),
        the policies of this stage's layers and the next layer id.
        """
        from vpipe.checkpoint import check_vpipe_state

        state = check_vpipe_state(dict(state))
        lm = self.layer_manager
        saved = sorted(lid for s in state["stages"] for lid in s)
        if saved != sorted(lm.order):
            raise ValueError(f"the checkpoint's layers {saved[:8]} are not this pipeline's layers {sorted(lm.order)[:8]}")
        policies = {int(k): Policy.parse(v) for k, v in state["policies"].items()}
        lm.epoch = state["epoch"]
        lm._next_id = max(lm._next_id, state["next_layer_id"])
        self.iteration = state["iteration"]
        if self.tensor_manager is not None:
            self.tensor_manager.set_policies({lid: policies.get(lid, Policy.KEEP) for lid in lm.layer_ids})
        self.session.agent.plan = Plan(epoch=lm.epoch, stages=lm.placement, policies=policies)
        self.session.monitor.epoch = lm.epoch
        if self.schedule is None:  # a hand-written loop: the open step gets the restored number
            self.session.monitor.abort_iteration()
            self._begin_step()
        decision("resumed", f"stage {self.stage_index} resumes at step {self.iteration}, plan epoch {lm.epoch}",
                 stage=self.stage_index, step=self.iteration, epoch=lm.epoch, layers=lm.layer_ids,
                 saved_stages=state["stages"], stages=[list(s) for s in lm.placement])

    def _at_exit(self) -> None:
        if not self._detached:
            self._exit_timeout_s = 5.0
            self.detach()

    _exit_timeout_s: float | None = None

    def memory_report(self) -> dict[str, Any]:
        """This stage's memory as vpipe accounts it: budget, fixed bytes, peak saved activations, policies."""
        tm = self.tensor_manager
        peak = tm.ledger.peak if tm is not None else 0
        fixed = self.fixed_bytes()
        policies = {str(lid): p.value for lid, p in tm.policies().items()} if tm is not None else {}
        return {"budget_bytes": self.memory_budget, "fixed_bytes": fixed, "peak_saved_bytes": peak,
                "footprint_bytes": fixed + peak, "policies": policies}

    def _set(self, key: str, value: str) -> None:
        self.store.set(key, value)
        self._written.append(key)

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
        for key in self._written:
            try:
                self.store.delete_key(key)
            except Exception as e:  # noqa: BLE001 - a store already gone (the run is ending) holds nothing
                log.debug("stage %d: could not delete store key %s: %s", self.stage_index, key, e)
        self._written.clear()
        decision("detached", f"vpipe detached from stage {self.stage_index}", stage=self.stage_index)
        if errors:
            raise RuntimeError(f"vpipe.detach could not undo everything: {errors[0]}") from errors[0]


# ---------------------------------------------------------------------- helpers
def _unpack_target(target: Any) -> tuple[Any, Any, nn.Module]:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from vpipe.migration.rebuild import check_schedule_api

    if isinstance(target, PipelineScheduleMulti):
        raise TypeError(f"vpipe.attach does not support multi-stage schedules ({type(target).__name__}) yet; "
                        "use one stage per rank (ScheduleGPipe, Schedule1F1B, SchedulePipeDream)")
    if isinstance(target, PipelineScheduleSingle):
        check_schedule_api(target)
        stage = target._stage
        return target, stage, _unwrap(stage.submod)
    if isinstance(target, nn.Module):
        return None, None, _unwrap(target)
    raise TypeError(f"vpipe.attach takes a pipelining schedule or a stage module, got {type(target).__name__}")


def _unwrap(module: nn.Module) -> nn.Module:
    """The stage module to find blocks in: refuse wrappers whose forward vpipe cannot see through."""
    wrapped = type(module).__name__
    if wrapped in ("DistributedDataParallel", "FullyShardedDataParallel") or hasattr(module, "_fsdp_wrapped_module"):
        raise TypeError(f"vpipe.attach does not support a stage module wrapped in {wrapped} yet: data-parallel "
                        "replicas of a pipeline need vpipe on a pipeline process group of its own")
    return module


def _check_optimizer(optimizer: torch.optim.Optimizer | None, module: nn.Module) -> None:
    """An optimizer that updates none of the stage's parameters would leave the model untrained, silently."""
    if optimizer is None:
        return
    mine = {id(p) for p in module.parameters()}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if mine and not mine & held:
        raise ValueError(f"vpipe.attach: the optimizer holds none of this stage's {len(mine)} parameters; pass the "
                         "optimizer built over this stage's module (e.g. torch.optim.AdamW(model.parameters()))")


def _check_group(stage: Any, world_size: int) -> None:
    """vpipe's moves and agreement run over the world: refuse a pipeline that is one dimension of a mesh."""
    if stage is None:
        return
    size = dist.get_world_size(getattr(stage, "group", None))  # None: the default group, the world
    if size != world_size:
        raise ValueError(f"vpipe.attach: this pipeline's process group has {size} of the world's {world_size} ranks "
                         "(a pipeline inside a larger mesh, e.g. with data-parallel replicas); vpipe supports one "
                         "pipeline over the whole world for now")
    if stage.stage_index != dist.get_rank():  # vpipe addresses a stage's peers by rank: never misroute a layer
        raise ValueError(f"vpipe.attach: stage {stage.stage_index} runs on rank {dist.get_rank()}; vpipe needs "
                         "stage i on rank i (as torch's single-stage schedules do)")


def _module_device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _default_store() -> Any:
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise RuntimeError("cannot find torch.distributed's store; pass store= to vpipe.attach")
    return getter()


def _own_error(exc: BaseException) -> BaseException | None:
    """The tensor manager's own error (budget, host pool) inside ``exc``'s cause chain, if ``exc`` wraps one."""
    from vpipe.tensor_manager import HostPoolFullError, MemoryBudgetError

    seen: set[int] = set()
    cause = exc.__cause__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (MemoryBudgetError, HostPoolFullError)):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__
    return None


class _MicroBatchCounter:
    """For hand-written loops: the n-th forward of the stage module since the last step is micro-batch n."""

    def __init__(self, module: nn.Module, manager: Any) -> None:
        self.manager = manager
        self.next_mb = 0
        self._open: Any = None
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, _module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():
            self._open = self.manager.micro_batch(self.next_mb)
            self._open.__enter__()

    def _post(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
            self.next_mb += 1

    def reset(self) -> None:
        self.next_mb = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
