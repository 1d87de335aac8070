"""The user's configuration of vpipe (:class:`VpipeConfig`, ``vpipe.VpipeConfig``): every option of
``attach``, validated when it is made.

What the user asks for, nothing a rank works out: the budget in bytes of ``"auto"`` and the
planner's configuration from the pipeline are :mod:`vpipe.rank.resolved`'s, at attach.
Torch-free, so a command can build and check one without loading torch. The fields whose
defaults a ``VPIPE_*`` variable sets take them from :func:`~vpipe.settings.process_settings`
(the environment read once per process), never from the environment again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vpipe.checks import require
from vpipe.plan import Policy
from vpipe.planner import DEFAULT_PLANNER
from vpipe.settings import Settings, parse_metric_kinds, process_settings
from vpipe.sizes import MAX_BYTES, parse_bytes

if TYPE_CHECKING:
    from torch import nn

__all__ = ["VpipeConfig", "AUTO_BUDGET"]

AUTO_BUDGET = "auto"


def _default(name: str) -> Any:
    """A field whose default a ``VPIPE_*`` variable sets: this process's settings,
    read once (a config made by ``attach(**options)`` gets every one from the
    settings attach checked, :meth:`VpipeConfig.from_settings`)."""
    return field(default_factory=lambda: getattr(process_settings(), name))


# the fields whose defaults come from the settings (the VPIPE_* variables), by their names in Settings
_FROM_SETTINGS = ("migration_timeout_s", "agree_timeout_s", "log_file", "trace_steps", "trace_dir", "metrics",
                  "metrics_dir")
_MAX_STEPS = 10**9  # a sampling interval or a micro-batch count beyond this is a mistake, not a setting
_MAX_LAG_STEPS = 10_000  # a plan applied this many steps after it was made is stale; beyond it, never applied
_MAX_LAYER_ID = 1 << 31
_MAX_SECONDS = 1e7  # about four months


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _plain_json(value: Any) -> bool:
    """Whether ``value`` crosses to the planner daemon as JSON unchanged (string keys, no NaN, no objects)."""
    try:
        return bool(json.loads(json.dumps(value, allow_nan=False)) == value)
    except (TypeError, ValueError):
        return False


def _seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 < value <= _MAX_SECONDS)


@dataclass
class VpipeConfig:
    """What vpipe does underneath the trainer. Every field is validated when attaching."""

    # bytes per rank: parameters, gradients, optimizer state, saved activations; "auto": the GPU's
    # capacity minus a margin (on CPU: no budget); None: no budget
    memory_budget: int | str | None = AUTO_BUDGET
    planning: bool = True  # run the planner daemon and apply its plans
    planner: str = DEFAULT_PLANNER  # the daemon's planner function (module:function): the online SRP planner
    # monitor every k-th step after attach and after each change (a plan, an edit, a change the pulse saw):
    # the planner hears of an uneven split within a few steps
    sample_every: int = 2
    # while nothing changes the interval doubles every 5 samples up to this (None: 40 *
    # sample_every; sample_every: never back off); the pulse (every step's stage
    # forward time) asks for samples again when something changes
    max_sample_every: int | None = None
    layers: str | None = None  # dotted path of the block container in the stage module (default: found)
    # builds a layer by (id, spec); default: clone one
    layer_factory: Callable[[int, Any], nn.Module] | None = None
    # layer id -> spec handed to the factory (plain msgpack-able values)
    specs: Mapping[int, Any] | None = None
    # weight averages of the stage module that move with its blocks: torch's AveragedModel,
    # dicts of tensors keyed by parameter name (vpipe.migration.carried);
    # on_move(BlockMoves) hears of each commit that moved blocks
    carry: Sequence[Any] = ()
    on_move: Callable[[Any], object] | None = None
    policies: Mapping[int, Policy | str] | None = None  # initial keep/swap/recompute per layer (default keep)
    tensor_manager: bool = True
    # every BatchNorm of the stage modules updates its running statistics once per
    # step, from the whole mini-batch, not once per micro-batch
    # (vpipe.stage.batch_norm); outputs and gradients stay plain BatchNorm's
    deferred_batch_norm: bool = False
    min_swap_bytes: int | None = None
    host_pool_bytes: int | None = None
    migration_timeout_s: float = _default("migration_timeout_s")  # default: $VPIPE_MIGRATION_TIMEOUT, else 30
    # how long attach (and a layer edit) waits for every rank to make the same call
    agree_timeout_s: float = _default("agree_timeout_s")  # default: $VPIPE_AGREE_TIMEOUT, else 120
    apply_lag_steps: int = 2  # stage 0 schedules a plan this many steps after it has it
    # per step of a hand-written loop (the planner models the pipeline with it)
    micro_batches: int | None = None
    # the planner's configuration, plain JSON values: for the default planner,
    # OnlineConfig fields (attach adds the pipeline's schedule, micro-batches,
    # budget); another planner gets them in its configured(config)
    planner_options: dict[str, Any] = field(default_factory=dict)
    # JSON lines of every decision; default: $VPIPE_LOG_FILE, so a one-line attach can be logged from outside
    log_file: str | None = _default("log_file")
    # (start, count): record the pipeline timeline of those steps on every rank (vpipe.timeline); default:
    # $VPIPE_TRACE_STEPS ("start,count"); each rank writes trace_dir/timeline-rank{r}.json at the window's end
    trace_steps: tuple[int, int] | None = _default("trace_steps")
    trace_dir: str = _default("trace_dir")  # default: $VPIPE_TRACE_DIR, else vpipe-trace
    # per-step scalars to "tensorboard", "wandb" or both ("tensorboard,wandb"); default: $VPIPE_METRICS;
    # written to metrics_dir/rank{r} (vpipe.rank.metrics lists the fields)
    metrics: str | None = _default("metrics")
    metrics_dir: str = _default("metrics_dir")  # default: $VPIPE_METRICS_DIR, else vpipe-metrics

    @classmethod
    def from_settings(cls, settings: Settings, **options: Any) -> VpipeConfig:
        """A config whose fields ``options`` does not set take their defaults from ``settings`` (what attach
        read of the environment), not from the environment again."""
        taken = {name: getattr(settings, name) for name in _FROM_SETTINGS if name not in options}
        return cls(**taken, **options)

    @property
    def sampling_cap(self) -> int:
        """The longest interval between sampled steps (``max_sample_every``,
        default 40 * ``sample_every``)."""
        return self.max_sample_every if self.max_sample_every is not None else 40 * self.sample_every

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            require(ok, f"vpipe config: {message}")

        if isinstance(self.memory_budget, str) and self.memory_budget != AUTO_BUDGET:
            try:  # "16GB", "15GiB", "16e9": read as everywhere else in vpipe
                self.memory_budget = parse_bytes(self.memory_budget, what="memory_budget")
            except ValueError as e:
                raise ValueError(f"vpipe config: {e}") from None

        need(self.memory_budget is None or self.memory_budget == AUTO_BUDGET
             or (isinstance(self.memory_budget, int) and not isinstance(self.memory_budget, bool)
                 and self.memory_budget > 0),
             f"memory_budget must be a positive number of bytes, 'auto' or None, got {self.memory_budget!r}")
        need(_int_in(self.sample_every, 1, _MAX_STEPS),
             f"sample_every must be an integer in [1, {_MAX_STEPS}], got {self.sample_every!r}")
        need(self.max_sample_every is None or _int_in(self.max_sample_every, self.sample_every, _MAX_STEPS),
             f"max_sample_every must be an integer >= sample_every ({self.sample_every}) or None, "
             f"got {self.max_sample_every!r}")
        for name in ("planning", "tensor_manager", "deferred_batch_norm"):
            need(isinstance(getattr(self, name), bool),
                 f"{name} must be True or False, got {getattr(self, name)!r}")
        need(isinstance(self.planner, str) and ":" in self.planner,
             f"planner must be 'module:function', got {self.planner!r}")
        need(self.layer_factory is None or callable(self.layer_factory), "layer_factory must be callable")
        need(isinstance(self.carry, (list, tuple)),
             f"carry must be a list of weight averages (AveragedModel, dicts "
             f"of tensors by parameter name), got a {type(self.carry).__name__}")
        need(self.on_move is None or callable(self.on_move), "on_move must be callable")
        need(self.layers is None or (isinstance(self.layers, str) and bool(self.layers.strip())),
             f"layers must be the dotted path of the block container (e.g. 'layers'), got {self.layers!r}")
        need(_seconds(self.migration_timeout_s),
             f"migration_timeout_s must be positive, got {self.migration_timeout_s!r}")
        need(_seconds(self.agree_timeout_s),
             f"agree_timeout_s must be positive, got {self.agree_timeout_s!r}")
        need(_int_in(self.apply_lag_steps, 1, _MAX_LAG_STEPS),
             f"apply_lag_steps must be an integer in [1, {_MAX_LAG_STEPS}], got {self.apply_lag_steps!r}")
        need(self.policies is None or (isinstance(self.policies, Mapping)
                                       and all(_int_in(k, 0, _MAX_LAYER_ID) for k in self.policies)),
             f"policies must map layer ids (integers >= 0) to 'D', 'S' or 'R', got {self.policies!r:.80}")
        for pol in (self.policies or {}).values():
            Policy.parse(pol.value if isinstance(pol, Policy) else pol)
        need(self.specs is None or isinstance(self.specs, Mapping),
             f"specs must be a mapping, got {self.specs!r:.80}")
        need(isinstance(self.planner_options, dict) and _plain_json(self.planner_options),
             f"planner_options must be a dict of plain JSON values, got {self.planner_options!r:.80}")
        need(self.min_swap_bytes is None or _int_in(self.min_swap_bytes, 0, MAX_BYTES),
             "min_swap_bytes must be >= 0")
        need(self.micro_batches is None or _int_in(self.micro_batches, 1, _MAX_STEPS),
             f"micro_batches must be a positive integer or None, got {self.micro_batches!r}")
        need(self.host_pool_bytes is None or _int_in(self.host_pool_bytes, 1, MAX_BYTES),
             "host_pool_bytes must be positive")
        need(self.log_file is None or (isinstance(self.log_file, (str, os.PathLike))),
             f"log_file must be a path or None, got {self.log_file!r:.80}")
        if self.trace_steps is not None:
            steps = tuple(self.trace_steps) if isinstance(self.trace_steps, (tuple, list)) else ()
            need(len(steps) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in steps)
                 and steps[0] >= 0 and steps[1] >= 1,
                 "trace_steps must be (start, count) with start >= 0 and count >= 1, got "
                 f"{self.trace_steps!r}")
            self.trace_steps = (steps[0], steps[1])
        need(isinstance(self.trace_dir, str) and bool(self.trace_dir.strip()),
             f"trace_dir must be a directory path, got {self.trace_dir!r}")
        need(self.metrics is None or isinstance(self.metrics, str),
             f"metrics must be 'tensorboard', 'wandb' or both comma-separated, got {self.metrics!r}")
        try:
            parse_metric_kinds(self.metrics)
        except ValueError as e:
            raise ValueError(f"vpipe config: {e}") from None
        need(isinstance(self.metrics_dir, str) and bool(self.metrics_dir.strip()),
             f"metrics_dir must be a directory path, got {self.metrics_dir!r}")

    def initial_policies(self) -> dict[int, Policy]:
        return {lid: Policy.parse(p.value if isinstance(p, Policy) else p)
                for lid, p in (self.policies or {}).items()}
