"""Which rank runs which pipeline stage, for every schedule the reference trainer runs.

Single-stage schedules (GPipe, 1F1B, PipeDream) run stage ``r`` on rank ``r``. The
multi-stage ones run several *virtual* stages per rank, laid out exactly as torch's
schedules map them (``generate_stage_to_rank_mapping``), so that the trainer builds on
each rank the stages its schedule will ask that rank to run:

- looped (Interleaved 1F1B, LoopedBFS, Interleaved zero bubble): rank ``r`` of ``W`` runs
  stages ``r, r + W, r + 2W, ...``;
- WPipe (vpipe's ``ScheduleWPipe``) is looped with exactly two stages per rank: G0's ``r``
  and G1's ``W + r``;
- V-shaped (ZBV, DualPipeV): exactly two stages per rank, ``r`` and ``2W - 1 - r``, so
  rank 0 holds both the first and the last stage.

Plain Python (no torch): the CLI validates a layout before it starts any process.
"""

from __future__ import annotations

__all__ = ["SINGLE_STAGE", "STREAMS", "MULTI_STAGE", "V_SHAPED", "SCHEDULES", "stage_rank", "rank_stages"]

SINGLE_STAGE = ("gpipe", "1f1b", "pipedream", "pipedream2bw")
STREAMS = ("pipedream", "pipedream2bw", "wpipe")  # vpipe's own schedules: no flush between steps
MULTI_STAGE = ("interleaved1f1b", "loopedbfs", "interleavedzb", "zbv", "dualpipev", "wpipe")
V_SHAPED = ("zbv", "dualpipev")
SCHEDULES = SINGLE_STAGE + MULTI_STAGE


def stage_rank(schedule: str, stage: int, ranks: int) -> int:
    """The rank that runs ``stage`` under ``schedule`` on ``ranks`` ranks."""
    if schedule in V_SHAPED:
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


def rank_stages(schedule: str, rank: int, ranks: int, per_rank: int) -> list[int]:
    """The stages ``rank`` runs, in model order (``per_rank`` of them)."""
    return sorted(v for v in range(ranks * per_rank) if stage_rank(schedule, v, ranks) == rank)
