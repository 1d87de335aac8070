"""What differs between the engines vpipe runs under, asked of one adapter per engine.

vpipe runs underneath a torch single-stage schedule, a torch multi-stage schedule, its own
PipeDream schedule, DeepSpeed's ``PipelineEngine`` or a plain stage module. Everything that
depends on which one it is (how a step is run and watched, the micro-batches per step, how
boundary shapes are redone after a move, whether layers may move or be edited and why not,
whether the schedule streams or flushes, how its checkpoints are laid out) is answered by
the :class:`Engine` adapter that :func:`vpipe.engines.engine_for` picks for what the trainer
passed to ``attach``; no other module asks which engine it is under.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vpipe.stage.pipeline import Pipeline, stage_edit_refusal, stage_move_refusal

__all__ = ["EngineKind", "Capabilities", "Engine", "Placement"]

Placement = tuple[tuple[int, ...], ...]


class EngineKind(enum.Enum):
    """The engines vpipe runs under (an engine registered by a user has a kind of its own, or ``OTHER``)."""

    TORCH_SINGLE = "torch_single"  # ScheduleGPipe, Schedule1F1B: one stage per rank
    TORCH_MULTI = "torch_multi"  # torch's schedules that run an action list: several stages per rank
    PIPEDREAM = "pipedream"  # vpipe's SchedulePipeDream: a stream, weight stashing
    PIPEDREAM_2BW = "pipedream_2bw"  # vpipe's SchedulePipeDream2BW: a stream, two weight versions
    WPIPE = "wpipe"  # vpipe's ScheduleWPipe: two stages a rank, G0 a stream with two weight versions, G1 one
    DEEPSPEED = "deepspeed"  # DeepSpeed's PipelineEngine
    MODULE = "module"  # a plain stage module in a hand-written loop
    OTHER = "other"


@dataclass(frozen=True)
class Capabilities:
    """What vpipe may do to this rank's layers, worked out once at attach: None where it may, else why not."""

    moves: str | None  # why layers cannot move to another stage (plans then apply their policies only)
    edits: str | None  # why add_layers / remove_layers refuse (a noun phrase: "<call> cannot edit <edits>")

    @property
    def can_move(self) -> bool:
        return self.moves is None

    @property
    def can_edit(self) -> bool:
        return self.edits is None


class Engine(abc.ABC):
    """One engine's adapter over this rank's :class:`~vpipe.stage.pipeline.Pipeline`.

    The defaults are a torch schedule's that flushes every step; each engine's module overrides what differs
    and says how to recognise its target (:meth:`accepts`) and read it (:meth:`read`).
    """

    kind: ClassVar[EngineKind] = EngineKind.OTHER
    # micro-batches stay in flight across steps (PipeDream), or every step flushes
    streams: ClassVar[bool] = False
    # the target's method that runs one step; None: the trainer's loop
    step_method: ClassVar[str | None] = "step"
    # micro-batches numbered by the stage module's forwards, not by actions
    counts_forwards: ClassVar[bool] = False
    replica_refusal: ClassVar[str | None] = None  # why data-parallel replicas of this pipeline are refused
    # why attach(carry=...) is refused (weight averages cannot move)
    carry_refusal: ClassVar[str | None] = None

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    # ------------------------------------------------------------------ recognising and reading a target
    @classmethod
    @abc.abstractmethod
    def accepts(cls, target: Any) -> bool:
        """Whether ``target`` (what the trainer passed to ``attach``) runs under this engine."""

    @classmethod
    @abc.abstractmethod
    def read(cls, target: Any) -> Engine:
        """This engine over ``target``: its stages on this rank read, what vpipe cannot run under refused."""

    # ------------------------------------------------------------------ running and watching a step
    @property
    def hand_written(self) -> bool:
        """Whether the trainer's own loop runs the steps (the optimizer's step marks the boundary)."""
        return self.step_method is None

    @property
    def name(self) -> str:
        """What the run log calls the target: its class, or ``module`` for a hand-written loop."""
        return "module" if self.hand_written else type(self.pipeline.schedule).__name__

    @property
    def stream(self) -> Any:
        """The schedule whose micro-batches stay in flight across steps (a moving stream switches layers
        mid-step), or None when every step flushes."""
        return self.pipeline.schedule if self.streams else None

    def default_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the engine brings when the trainer passes none."""
        return None

    def weight_versions(self, stage: int) -> int:
        """The copies of a stage's weights held at once (a stream's stashed versions)."""
        return 1

    def reset_shapes(self) -> None:  # noqa: B027 - engines without shape inference do nothing
        """A move changed what a stage sends downstream: make the next step size the boundary activations anew
        (every rank at the same boundary)."""

    # ------------------------------------------------------------------ what may change
    def capabilities(self, *, has_factory: bool, optimizer_refusal: str | None = None) -> Capabilities:
        """Whether layers may move and be edited, and why not: the stages' rules first, then the engine's.
        Asked once, after the stages agreed on their blocks."""
        moves = stage_move_refusal(self.pipeline, has_factory) or self.move_refusal() or optimizer_refusal
        return Capabilities(moves=moves, edits=stage_edit_refusal(self.pipeline) or self.edit_refusal())

    def move_refusal(self) -> str | None:
        """The engine's own reason its layers cannot move, or None."""
        return None

    def edit_refusal(self) -> str | None:
        """The engine's own reason its layers cannot be added or removed (a noun phrase), or None."""
        return None

    def plan_refusal(self, start: Placement, stages: Placement) -> str | None:
        """Why the engine cannot take its layers from placement ``start`` to ``stages`` (a boundary it keeps
        fixed), or None."""
        return None

    def unsettled(self) -> str | None:
        """Why the layers cannot be edited at this step boundary (a
        stream still holds micro-batches), or None."""
        return None

    # ------------------------------------------------------------------ what vpipe keeps in step
    def recomputes_itself(self) -> str | None:
        """Why the engine recomputes the blocks' activations itself
        (vpipe's tensor managers then stay off)."""
        return None

    def fixed_layers(self) -> Mapping[int, str]:
        """This rank's layers that are not blocks and never move, said once at attach: layer id -> why."""
        return {}

    def own_copies(self) -> list[object]:
        """What the schedule itself keeps beside the stages' weights (a stream's stashed versions, keyed by
        parameter name like a trainer's average): the scan for averages at attach passes over them."""
        return []

    def followers(self) -> list[Any]:
        """Objects told of every block that arrives or leaves and of every plan in force (the engine's own
        record of the layers)."""
        return []

    @property
    def checkpoint_home(self) -> Placement | None:
        """The placement the engine's own checkpoints are written and read on (its ``save_checkpoint`` and
        ``load_checkpoint`` run there), or None where vpipe's checkpoints hold any placement."""
        return None
