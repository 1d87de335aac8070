"""How the stages of one rank share what its memory budget leaves for saved activations.

A multi-stage schedule runs several stages on one rank, under one budget. Each stage's
tensor manager enforces a part of it, so the rank's room must be divided. Keeping every
layer, stage ``v`` needs ``in_flight[v] x kept[v]`` at its own peak (micro-batches in flight
times one micro-batch's kept bytes), but the stages of a rank do not peak at once: under
interleaved 1F1B the first stage holds four micro-batches while the rank's later stage
holds none yet. The rank's real peak is the largest sum over the moments of its action
list (``together``: at each forward, how many micro-batches each of its stages holds). The
plain schedule runs wherever that real peak fits; so when it fits, each stage's share is its
own peak scaled by room over real peak, which is at least what it needs even though the
shares add up to more than the room (their peaks never coincide). When keeping every layer
does not fit, or a stage has not measured its bytes yet, the caller shares equally.

The in-flight counts and moments are read off torch's action lists (``pipeline_order``: a
rank's list of actions, each with a ``computation_type``, ``stage_index`` and
``microbatch_index``) by :func:`in_flight_per_stage` and :func:`in_flight_together`.

Used by the ranks (``vpipe.rank.memory``), the online planner, ``vpipe plan`` and the
reference fit, so all of them divide a rank's budget the same way. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["keep_all_shares", "joint_peak", "in_flight_per_stage", "in_flight_together", "flat_actions",
           "action_kind"]


def joint_peak(kept: Sequence[float], in_flight: Sequence[int],
               together: Sequence[Sequence[int]] | None = None) -> float:
    """The rank's peak bytes with every layer kept: the largest moment of ``together`` (micro-batches each
    stage holds at one moment, a column per stage of ``kept``), and never less than one stage's own peak;
    without moments, every stage peaks at once (the sum)."""
    own = [max(1, count) * size for count, size in zip(in_flight, kept)]
    if not together:
        return float(sum(own))
    moments = (sum(count * size for count, size in zip(row, kept)) for row in together)
    return float(max(max(moments), max(own, default=0)))


def keep_all_shares(room: float, kept: Sequence[float], in_flight: Sequence[int],
                    together: Sequence[Sequence[int]] | None = None,
                    stages: Sequence[int] | None = None) -> list[float] | None:
    """Each stage's share of ``room`` when the rank's peak with every layer kept fits it, else None.

    ``kept``: one micro-batch's kept bytes per stage (0: not measured); ``in_flight``: each
    stage's peak micro-batches; ``together``: the moments (see :func:`joint_peak`), a
    column per stage of ``kept``, or, with ``stages`` (the pipeline indices of the stages
    ``kept`` is for), a column per stage of the pipeline."""
    if together and stages is not None:
        together = [[row[v] for v in stages] for row in together]
    if len(kept) != len(in_flight) or any(len(row) != len(kept) for row in together or ()):
        raise ValueError(f"{len(kept)} stages' kept bytes, {len(in_flight)} in-flight counts and moments of "
                         f"{sorted({len(row) for row in together or ()})} stages do not match")
    if not kept or not all(kept) or room <= 0:
        return None
    peak = joint_peak(kept, in_flight, together)
    if peak > room:
        return None
    return [room * max(1, count) * size / peak for count, size in zip(in_flight, kept)]


def in_flight_per_stage(pipeline_order: dict[int, Sequence[Any]], num_stages: int) -> list[int]:
    """For every stage, the most micro-batches whose forward ran and whose backward (the weight pass,
    under a zero-bubble schedule) has not: what it holds activations of at its peak."""
    moments = in_flight_together(pipeline_order, num_stages)
    return [max([1, *(row[v] for row in moments)]) for v in range(num_stages)]


def in_flight_together(pipeline_order: dict[int, Sequence[Any]], num_stages: int) -> list[list[int]]:
    """At each forward of each rank, how many micro-batches every stage holds (a row per moment, a column per
    stage; rows that another row covers are dropped): a rank's stages do not peak at once, and its peak is
    its largest row (``vpipe.sharing``)."""
    rows: set[tuple[int, ...]] = set()
    for actions in pipeline_order.values():
        held: list[set[int]] = [set() for _ in range(num_stages)]
        for action in flat_actions(actions):
            kind = action_kind(action)
            if kind == "F":
                held[action.stage_index].add(action.microbatch_index)
                rows.add(tuple(len(h) for h in held))
            elif kind in ("B", "W"):
                held[action.stage_index].discard(action.microbatch_index)
    return [list(row) for row in sorted(rows)
            if not any(other != row and all(o >= r for o, r in zip(other, row)) for other in rows)]


def flat_actions(actions: Sequence[Any]) -> list[Any]:
    """A rank's actions from torch's lists with overlapped ones (DualPipeV's forward + backward pairs)
    unpacked and idle slots dropped."""
    out = []
    for action in actions:
        if action is None:
            continue
        if getattr(action, "sub_actions", None):
            out.extend(flat_actions(action.sub_actions))
        else:
            out.append(action)
    return out


def action_kind(action: Any) -> str:
    """The action's computation as torch writes it in its lists: F, B, I, W, SEND_F, ..."""
    return getattr(action.computation_type, "value", str(action.computation_type))
