"""The parts of one rank that the step driver, the plan applier, the layer edits and the state share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vpipe.control.session import ControlSession
from vpipe.engines import Engine
from vpipe.migration.layer_manager import LayerManager
from vpipe.rank.memory import StageMemory
from vpipe.rank.plan_in_force import PlanInForce
from vpipe.stage.pipeline import Pipeline
from vpipe.tensor_manager import TensorManager

__all__ = ["RankParts"]


@dataclass(frozen=True)
class RankParts:
    """What ``vpipe.attach`` built for this rank, handed on as one value.

    ``tensor_managers`` and ``memories`` are keyed by the index of each stage the rank runs
    (no tensor managers with ``tensor_manager=False``). ``engine`` answers what differs between the engines
    vpipe runs under (how shapes are redone after a move, whether the schedule streams).
    """

    pipeline: Pipeline
    layer_manager: LayerManager
    session: ControlSession
    tensor_managers: Mapping[int, TensorManager]
    memories: Mapping[int, StageMemory]
    plan_in_force: PlanInForce
    engine: Engine
