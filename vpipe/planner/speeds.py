"""How fast each stage's device runs the blocks it holds, learnt from the blocks' measured times.

A pipeline's devices are not always alike: an older or throttled GPU, a straggler, a GPU
shared with another job take longer for the same block. The planner must see that, or a
slow stage's blocks look like everyone else's and the pipeline looks balanced. What it has
are measured times of blocks on stages; a block's time there is the stage's factor times
the block's work. Blocks of one kind (same class, shapes, saved and sent bytes, and
trainable or frozen) do the same work, so their times on two stages give the ratio of the
two stages' factors; a block measured before and after it moved does too. All such pairs
are fitted at once in the log domain (``log time = log factor(stage) + log work(group)``,
alternating least squares over the groups seen on two or more stages), relative to the
fastest stage.

Noise must not look like a slow device: factors within ``dead_band`` of the fastest count
as 1.0, and a pipeline whose factors all do is even (the planner then pools interchangeable
blocks across all stages, as on identical devices).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

__all__ = ["fit_stage_speeds", "steady_speeds", "SpeedSamples", "describe_speeds", "interchangeable",
           "pooled_costs",
           "DEAD_BAND"]

STRONG = 1.6  # a stage this much slower than the fastest is believed after a few samples; less needs more
# a stage this close to the fastest (relative) runs at its speed: the rest is measurement noise
DEAD_BAND = 0.25
_ROUNDS = 60


def fit_stage_speeds(observations: Iterable[tuple[Hashable, int, float]], num_stages: int,
                     dead_band: float = DEAD_BAND) -> tuple[float, ...]:
    """Each stage's time factor (>= 1.0, the fastest stage 1.0) from ``(group, stage, seconds)`` observations.

    A stage that shares no group with another keeps 1.0 (nothing to compare it with).
    """
    cells: dict[tuple[Hashable, int], list[float]] = defaultdict(list)
    for group, stage, seconds in observations:
        if seconds > 0 and math.isfinite(seconds) and 0 <= stage < num_stages:
            cells[(group, stage)].append(seconds)
    by_group: dict[Hashable, dict[int, float]] = defaultdict(dict)
    for (group, stage), times in cells.items():
        by_group[group][stage] = math.log(statistics.median(times))
    shared = [stages for stages in by_group.values() if len(stages) >= 2]
    if not shared:
        return (1.0,) * num_stages
    known = sorted({stage for stages in shared for stage in stages})
    log_factor = dict.fromkeys(known, 0.0)
    for _ in range(_ROUNDS):
        work = [statistics.fmean(t - log_factor[s] for s, t in stages.items()) for stages in shared]
        new = {s: statistics.fmean(stages[s] - w for stages, w in zip(shared, work) if s in stages)
               for s in known}
        lowest = min(new.values())
        new = {s: v - lowest for s, v in new.items()}
        settled = max(abs(new[s] - log_factor[s]) for s in known) < 1e-9
        log_factor = new
        if settled:
            break
    factors = [math.exp(log_factor.get(stage, 0.0)) for stage in range(num_stages)]
    return tuple(1.0 if f < 1.0 + dead_band else round(f, 3) for f in factors)


def steady_speeds(samples: Sequence[Sequence[float]], num_stages: int, dead_band: float = DEAD_BAND,
                  needed: int = 3, weak_needed: int = 6, strong: float = STRONG) -> tuple[float, ...]:
    """The stages' factors over the last samples (all 1.0 before ``needed`` samples).

    A stage is slower when it was in every one of the last ``needed`` samples (a busy core slows one stage
    in some samples, a slower device in every one), or, at ``strong`` or more, in most of the last
    ``weak_needed`` (a busy core on the fastest stage makes one sample of a slow device look even). A
    factor below ``strong`` must hold in all of the last ``weak_needed``: ranks that share cores measure
    each other 1.3-1.5x apart for several samples in a row, a device that much slower stays so. Its value
    is the median of the samples that saw it slower (the least one followed every dip that a busy reference
    stage made, and moved blocks back and forth with it).
    """
    if len(samples) < needed:
        return (1.0,) * num_stages
    window = samples[-weak_needed:]
    factors = []
    for k in range(num_stages):
        relative = [sample[k] / min(sample) for sample in window]
        slower = [f for f in relative if f >= 1.0 + dead_band]
        value = statistics.median(slower) if slower else 1.0
        full = len(window) >= weak_needed
        slow = (min(relative[-needed:]) >= strong or full and min(relative) >= 1.0 + dead_band
                or full and statistics.median(relative) >= strong)
        factors.append(round(value, 3) if slow else 1.0)
    return tuple(factors)


class SpeedSamples:
    """The last samples' stage factors, each with the step it was measured at.

    When a rank's pulse sees its stage change, the samples measured before the change say nothing
    of the devices now, and those measured after it do: a pulse names a change only after several
    steps at the new level, and a neighbour's pulse often fires a few steps after the stage that
    changed (its waits changed with it). Dropping every sample then threw away what the planner
    had just learnt and cost a straggler about ten steps.
    """

    def __init__(self, keep: int) -> None:
        self._samples: deque[tuple[int, tuple[float, ...]]] = deque(maxlen=keep)

    def add(self, iteration: int, factors: tuple[float, ...]) -> None:
        self._samples.append((iteration, factors))

    def drop_before(self, iteration: int) -> None:
        """Forget the samples measured before ``iteration``."""
        kept = [(at, factors) for at, factors in self._samples if at >= iteration]
        self._samples.clear()
        self._samples.extend(kept)

    def of(self, num_stages: int) -> list[tuple[float, ...]]:
        """The kept factors of pipelines of ``num_stages`` stages, oldest first."""
        return [factors for _, factors in self._samples if len(factors) == num_stages]


def describe_speeds(factors: tuple[float, ...]) -> str:
    """One line a user reads: which stages run their blocks slower than the fastest, and by how much."""
    fastest = min(range(len(factors)), key=lambda k: factors[k])
    slow = [k for k, f in enumerate(factors) if f > 1.0]
    if not slow:
        return "the stages run their blocks at the same speed"
    parts = [f"stage {k} runs its blocks {factors[k] / factors[fastest]:.1f}x slower than stage {fastest}"
             for k in slow]
    return "; ".join(parts)


def pooled_costs(order: list[int], records: dict[int, Any],
                 costs: dict[int, list[float]]) -> dict[int, list[float]]:
    """Per layer [fwd_s, bwd_s]: the median over the blocks it is interchangeable with.

    Blocks of one kind (class, parameter shapes) that save and send the same bytes run the
    same kernels on the same shapes; on the same kind of device their measured times differ
    only by noise (timer jitter, a busy core), which must not look like imbalance. Blocks
    of unknown kind ("") keep their own times.
    """
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for lid in order:
        group = interchangeable(records[lid])
        if group:
            groups[group].append(lid)
    pooled = {lid: costs[lid] for lid in order}
    for members in groups.values():
        if len(members) > 1:
            median = [statistics.median(costs[lid][i] for lid in members) for i in (0, 1)]
            pooled.update({lid: median for lid in members})
    return pooled


def interchangeable(rec: Any) -> tuple[Any, ...] | None:
    """What makes blocks interchangeable: kind, saved and sent bytes, and whether they train (a frozen block's
    backward has no weight gradients to compute). None for a block of unknown kind."""
    return (rec.kind, rec.activation_bytes, rec.output_bytes, rec.trainable) if rec.kind else None
