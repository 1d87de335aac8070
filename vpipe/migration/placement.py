"""Where every layer of the model is: the placement over (virtual) stages, and which rank runs each stage.

A rank runs one stage under the single-stage schedules and several under the multi-stage
ones (Interleaved 1F1B, LoopedBFS, the zero-bubble schedules): their stages are *virtual*,
numbered in model order, and ``stage_ranks[v]`` is the rank that runs stage ``v``. Moves go
between neighbouring virtual stages; two neighbours can be on one rank (a V-shaped
schedule's turn, or any interleaved layout with one rank), and then a move is a local
re-parenting with nothing sent.

This module is plain bookkeeping, the same on every rank: no torch, no messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """Layer ids per stage, in model order, and the rank of every stage."""

    stages: tuple[tuple[int, ...], ...]
    stage_ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.stages) != len(self.stage_ranks):
            raise ValueError(f"{len(self.stages)} stages but {len(self.stage_ranks)} stage ranks")
        order = self.order
        if len(set(order)) != len(order):
            raise ValueError("a layer is placed twice")

    @classmethod
    def of(cls, stages: Sequence[Sequence[int]], stage_ranks: Sequence[int] | None = None) -> Placement:
        ranks = tuple(range(len(stages))) if stage_ranks is None else tuple(stage_ranks)
        return cls(tuple(tuple(s) for s in stages), ranks)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def order(self) -> list[int]:
        """Every layer of the model, in execution order."""
        return [lid for layers in self.stages for lid in layers]

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, in model order."""
        return [v for v, r in enumerate(self.stage_ranks) if r == rank]

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def stage_holding(self, layer_id: int) -> int:
        for s, layers in enumerate(self.stages):
            if layer_id in layers:
                return s
        raise ValueError(f"layer {layer_id} is not placed")

    def with_stages(self, stages: Sequence[Sequence[int]]) -> Placement:
        return Placement(tuple(tuple(s) for s in stages), self.stage_ranks)

    def with_added(self, position: int, new_ids: Sequence[int]) -> tuple[Placement, int, int]:
        """New layers before model position ``position`` (at the end: on the last stage).

        They join the stage that holds the layer at ``position``. Returns the placement, that
        stage and the index in it where they went.
        """
        order = self.order
        if not 0 <= position <= len(order):
            raise ValueError(f"position {position} is outside 0..{len(order)}")
        clash = set(new_ids) & set(order)
        if clash:
            raise ValueError(f"new layer ids {sorted(clash)} are already in use")
        if position < len(order):
            owner = self.stage_holding(order[position])
            at = self.stages[owner].index(order[position])
        else:
            owner, at = self.num_stages - 1, len(self.stages[-1])
        stages = [list(layers) for layers in self.stages]
        stages[owner][at:at] = list(new_ids)
        return self.with_stages(stages), owner, at

    def without(self, layer_ids: Iterable[int]) -> Placement:
        """The placement with ``layer_ids`` removed; no stage may be left empty."""
        doomed = set(layer_ids)
        unknown = doomed - set(self.order)
        if unknown:
            raise ValueError(f"cannot remove unknown layers {sorted(unknown)}")
        stages = [[lid for lid in layers if lid not in doomed] for layers in self.stages]
        empty = [s for s, layers in enumerate(stages) if not layers]
        if empty:
            raise ValueError(f"removing {sorted(doomed)} would leave stage(s) {empty} without layers")
        return self.with_stages(stages)

    def as_lists(self) -> list[list[int]]:
        return [list(s) for s in self.stages]
