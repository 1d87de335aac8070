"""From a new placement to neighbour moves.

Stages hold contiguous runs of the model's layers, so a placement change is a shift of
stage boundaries, and every layer that changes stage moves towards its new stage one
neighbour at a time. A layer two stages away makes two hops in two consecutive rounds;
the moves of one round happen together (each stage at most sends a prefix to its left
neighbour and a suffix to its right neighbour).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Move", "plan_rounds", "apply_round"]

Placement = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Move:
    """Layers (in model order) that go from stage ``src`` to its neighbour ``dst``."""

    src: int
    dst: int
    layers: tuple[int, ...]

    @property
    def forward(self) -> bool:
        """True when the layers move downstream (appended to the front of ``dst``)."""
        return self.dst == self.src + 1


def _validate(placement: Sequence[Sequence[int]], what: str) -> Placement:
    stages = tuple(tuple(s) for s in placement)
    for i, layers in enumerate(stages):
        if not layers:
            raise ValueError(f"{what} leaves stage {i} without layers")
    return stages


def plan_rounds(current: Sequence[Sequence[int]], target: Sequence[Sequence[int]]) -> list[list[Move]]:
    """Rounds of neighbour moves that turn ``current`` into ``target``.

    Both placements must cover the same layers in the same order with the same number of
    stages. In each round every misplaced layer moves one stage towards its target.
    """
    cur = _validate(current, "current placement")
    tgt = _validate(target, "target placement")
    if len(cur) != len(tgt):
        raise ValueError(f"placements have {len(cur)} and {len(tgt)} stages")
    order = [lid for layers in cur for lid in layers]
    if order != [lid for layers in tgt for lid in layers]:
        raise ValueError("placements must hold the same layers in the same order")
    target_stage = {lid: s for s, layers in enumerate(tgt) for lid in layers}
    rounds: list[list[Move]] = []
    while cur != tgt:
        moves = []
        for s, layers in enumerate(cur):
            left = tuple(lid for lid in layers if target_stage[lid] < s)
            right = tuple(lid for lid in layers if target_stage[lid] > s)
            if left:
                moves.append(Move(s, s - 1, left))
            if right:
                moves.append(Move(s, s + 1, right))
        cur = apply_round(cur, moves)
        rounds.append(moves)
    return rounds


def apply_round(placement: Sequence[Sequence[int]], moves: Sequence[Move]) -> Placement:
    """The placement after one round of moves (checked: contiguous, no stage emptied)."""
    stages = [list(layers) for layers in placement]
    for m in moves:
        if abs(m.dst - m.src) != 1 or not (0 <= m.src < len(stages) and 0 <= m.dst < len(stages)):
            raise ValueError(f"move {m} is not between neighbouring stages")
        held = stages[m.src]
        n = len(m.layers)
        expected = held[:n] if not m.forward else held[-n:]
        if tuple(expected) != m.layers:
            side = "suffix" if m.forward else "prefix"
            raise ValueError(f"move {m}: layers must be the {side} of stage {m.src}, which holds {held}")
    result = [list(layers) for layers in placement]
    for m in moves:
        for lid in m.layers:
            result[m.src].remove(lid)
    for m in moves:
        if m.forward:
            result[m.dst] = list(m.layers) + result[m.dst]
        else:
            result[m.dst] = result[m.dst] + list(m.layers)
    return _validate(result, "a migration round")
