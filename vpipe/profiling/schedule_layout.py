"""A multi-stage schedule's layout for ``vpipe plan``, read off torch's own action lists.

The live planner plans a multi-stage schedule with what the ranks read off the schedule's
action lists when ``vpipe.attach`` inspects it: the rank of every (virtual) stage, the
micro-batches each stage holds at its peak, and the moments a rank's stages hold them
together (:mod:`vpipe.sharing`). ``vpipe plan --schedule interleaved1f1b --stages-per-rank
2`` must plan with the same numbers, so it asks torch for the same action lists (torch's
schedule visualizer builds them without processes or devices) and reads them with the
same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed.pipelining as pipelining

from vpipe.compat.torch_distributed import get_schedule_ops
from vpipe.schedules.wpipe_order import steady_order
from vpipe.sharing import flat_actions, in_flight_per_stage, in_flight_together

__all__ = ["ScheduleLayout", "schedule_layout", "TORCH_CLASSES"]

# the cost model's names -> torch's schedule classes (torch.distributed.pipelining)
TORCH_CLASSES = {
    "interleaved1f1b": "ScheduleInterleaved1F1B", "loopedbfs": "ScheduleLoopedBFS",
    "interleavedzb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


@dataclass(frozen=True)
class ScheduleLayout:
    """Per virtual stage: its rank and its peak in-flight micro-batches;
    the rows of micro-batches held together."""

    stage_ranks: list[int]
    in_flight: list[int]
    together: list[list[int]]


def schedule_layout(schedule: str, ranks: int, stages_per_rank: int, micro_batches: int) -> ScheduleLayout:
    """What the ranks would read off ``schedule``'s action lists;
    ``ValueError`` (one line) if torch refuses it."""
    if schedule == "wpipe":
        return _wpipe_layout(ranks, stages_per_rank, micro_batches)
    if get_schedule_ops is None:
        raise ValueError(f"this torch has no schedule visualizer to read {schedule}'s action lists from")
    cls = getattr(pipelining, TORCH_CLASSES[schedule])
    try:
        lists = get_schedule_ops(cls, ranks, micro_batches, stages_per_rank)
    except Exception as e:  # noqa: BLE001 - torch's own check of the combination, reported as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"torch's {TORCH_CLASSES[schedule]} refuses {ranks} ranks x "
                         f"{stages_per_rank} stages with {micro_batches} micro-batches: {first}") from None
    order: dict[int, Sequence[Any]] = dict(enumerate(lists))
    num_stages = ranks * stages_per_rank
    owner: dict[int, int] = {}
    for rank, actions in order.items():
        for action in flat_actions(actions):
            owner.setdefault(action.stage_index, rank)
    if sorted(owner) != list(range(num_stages)):
        raise ValueError(f"torch's {TORCH_CLASSES[schedule]} action lists run stages {sorted(owner)}, "
                         f"not the {num_stages} stages of {ranks} ranks x {stages_per_rank}")
    return ScheduleLayout(stage_ranks=[owner[v] for v in range(num_stages)],
                          in_flight=in_flight_per_stage(order, num_stages),
                          together=in_flight_together(order, num_stages))


def _wpipe_layout(ranks: int, stages_per_rank: int, micro_batches: int) -> ScheduleLayout:
    """vpipe's ScheduleWPipe writes its own lists (the steady step's, what its ranks read): stage ``v`` on
    rank ``v mod W``, two stages a rank, at least ``W`` micro-batches a step."""
    if stages_per_rank != 2:
        raise ValueError(f"wpipe runs exactly 2 stages per rank (G0's and G1's), got {stages_per_rank}")
    if micro_batches < ranks:
        raise ValueError(f"wpipe needs at least as many micro-batches per step as ranks "
                         f"({micro_batches} < {ranks})")
    order: dict[int, Sequence[Any]] = dict(steady_order(ranks, micro_batches))
    num_stages = 2 * ranks
    return ScheduleLayout(stage_ranks=[v % ranks for v in range(num_stages)],
                          in_flight=in_flight_per_stage(order, num_stages),
                          together=in_flight_together(order, num_stages))
