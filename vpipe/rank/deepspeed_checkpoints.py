"""DeepSpeed's own checkpoints under vpipe: written and read on the partition DeepSpeed built.

DeepSpeed writes each layer to a file of its own, named by its global index, and each
stage's optimizer state to one file per stage, by position in that stage's optimizer. The
layer files do not care where a layer runs; the optimizer files do: a plain DeepSpeed run,
which builds the original partition, can only resume from the state of the original
partition's stages. So ``engine.save_checkpoint`` and ``engine.load_checkpoint`` (wrapped as
instance attributes, every rank calls them together) first move the layers back to where
DeepSpeed put them ("home"); a save then moves them back to the plan in force, a load
leaves them home (the planner moves them again when it is worth it). A checkpoint vpipe
wrote therefore resumes in DeepSpeed alone, and one DeepSpeed wrote resumes under vpipe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vpipe.log import decision
from vpipe.plan import Plan
from vpipe.rank.parts import RankParts

__all__ = ["HomeCheckpoints"]

Placement = tuple[tuple[int, ...], ...]


class HomeCheckpoints:
    """Wraps an engine's ``save_checkpoint`` and ``load_checkpoint`` to run on its home partition (the
    engine's :attr:`~vpipe.engines.base.Engine.checkpoint_home`: DeepSpeed's)."""

    def __init__(self, parts: RankParts, home: Placement) -> None:
        self.parts = parts
        self.home = home
        self.stage = parts.pipeline.first.index

    def install(self) -> Callable[[], None]:
        """Wrap the engine's methods; returns the undo."""
        engine = self.parts.pipeline.schedule
        save, load = engine.save_checkpoint, engine.load_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            return self.save(save, *args, **kwargs)

        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            return self.load(load, *args, **kwargs)

        engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint

        def undo() -> None:
            for name in ("save_checkpoint", "load_checkpoint"):
                engine.__dict__.pop(name, None)

        return undo

    def save(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        placed = self.parts.plan_in_force.placement
        self._move_to(self.home, "home for DeepSpeed's save_checkpoint")
        try:
            return original(*args, **kwargs)
        finally:
            self._move_to(placed, "back after DeepSpeed's save_checkpoint")

    def load(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._move_to(self.home, "home for DeepSpeed's load_checkpoint")
        return original(*args, **kwargs)

    def _move_to(self, placement: Placement, why: str) -> None:
        """Move the layers to ``placement`` now and make it the plan in force (same epoch, same policies)."""
        lm, owner = self.parts.layer_manager, self.parts.plan_in_force
        if owner.placement == placement:
            return
        plan = owner.plan
        moving = Plan(epoch=plan.epoch, stages=placement, policies=plan.policies, reason=why)
        report = lm.apply(moving, owner.placement)
        if report.rebuilt:  # as the plan applier does
            self.parts.engine.reset_shapes()
        owner.commit(Plan(epoch=plan.epoch, stages=report.placement, policies=plan.policies,
                          predicted_step_s=plan.predicted_step_s, reason=plan.reason), "restored")
        if report.placement != placement:
            raise RuntimeError(f"vpipe could not move the layers {why} (a move aborted; the run "
                               f"log says why): they are at {[list(s) for s in report.placement]}, not "
                               f"{[list(s) for s in placement]}")
        decision("checkpoint_placement", f"stage {self.stage}: layers moved {why}",
                 stage=self.stage, layers=list(placement[self.stage]))
