"""The fixed facts of a pipeline a plan is made for: its schedule's rules and the hardware.

*In flight*: the micro-batches whose activations stage ``k`` holds at its peak: GPipe
``m``, 1F1B ``min(p - k, m)``, PipeDream and PipeDream-2BW ``p - k`` (vPipe eq. 1, k from 0;
the WPipe paper's Table 1); PipeDream also stashes ``p - k`` weight versions, 2BW two.

*Step time* for ``m`` micro-batches: flush schedules (GPipe, 1F1B) ``sum_k t_k + (m - 1) *
max_k t_k`` (fill and drain, the bubble); PipeDream and 2BW (no flush) ``m * max_k t_k``.

*Several stages per rank* (Interleaved 1F1B, LoopedBFS, the zero-bubble schedules; their
stages are virtual, ``stage_ranks[v]`` runs stage ``v``): a rank runs its stages one after
another, so a micro-batch costs rank ``r`` ``T_r = sum of t_v over its stages``, and a step
``m * max_r T_r`` plus the bubble, which a virtual stage fills and drains once per rank
boundary: ``(W - 1) * max_v t_v`` for the interleaved and looped schedules (W ranks), a
third of that for the zero-bubble ones (ZB-H1 keeps about a third of 1F1B's bubble; ZBV
and DualPipeV no more). Each virtual stage holds its own in-flight micro-batches, read off
the schedule's action lists by the ranks (``in_flight_counts``), and gets an equal share of
its rank's memory budget. WPipe (vpipe's ``ScheduleWPipe``) is planned the same way: two
virtual stages a rank (G0's ``r``, G1's ``W + r``), its in-flight counts from the lists the
schedule writes (G0's stage ``r`` ``m + W - r``, G1's ``W - r``), the looped schedules'
bubble (an upper bound: G0's actions fill part of G1's fill and drain), and two weight
versions on G0's stages, one on G1's (the WPipe paper's Table 1).

*Uneven devices*: ``stage_speeds[k]`` is how much longer stage ``k`` takes for the same
compute than the reference device (1.0; 2.0 for a device half as fast, a straggler or an
older GPU). A layer's ``fwd``/``bwd`` are its times on the reference device, so on stage
``k`` its compute costs ``stage_speeds[k]`` times them; copies and transfers run on links,
not on the device's cores, and keep their times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

import numpy as np

from vpipe.plan import Policy

__all__ = ["RULES", "ScheduleRules",
           "SCHEDULES", "STREAMS", "MULTI_STAGE", "ZERO_BUBBLE", "FIXED_BOUNDARIES",
           "Schedule", "Code", "Hardware", "PipelineSetup",
           "check_schedule", "streams", "in_flight", "weight_versions", "pipeline_step_time", "throughput"]

Schedule = Literal["gpipe", "1f1b", "pipedream", "pipedream2bw"]  # the one-stage-per-rank schedules


@dataclass(frozen=True)
class ScheduleRules:
    """What the cost model knows of a one-stage-per-rank schedule: adding one is one row of :data:`RULES`."""

    streams: bool  # no flush: micro-batches stay in flight across steps, no bubble
    # (stage, stages, micro-batches) -> activations held at the peak
    in_flight: Callable[[int, int, int], int]
    versions: Callable[[int, int], int]  # (stage, stages) -> weight versions held (live and stashed)


RULES: dict[str, ScheduleRules] = {
    "gpipe": ScheduleRules(False, lambda k, p, m: m, lambda k, p: 1),
    "1f1b": ScheduleRules(False, lambda k, p, m: max(1, min(p - k, m)), lambda k, p: 1),
    "pipedream": ScheduleRules(True, lambda k, p, m: p - k, lambda k, p: p - k),  # a version per micro-batch
    "pipedream2bw": ScheduleRules(True, lambda k, p, m: p - k, lambda k, p: 2),  # double-buffered weights
}
SCHEDULES: tuple[str, ...] = tuple(RULES)
STREAMS: tuple[str, ...] = tuple(name for name, rules in RULES.items() if rules.streams)
# several (virtual) stages per rank: planned with the in-flight counts and stage ranks the ranks read off the
# schedule's action lists; "custom" is an action list loaded from a file
MULTI_STAGE: tuple[str, ...] = ("interleaved1f1b", "loopedbfs", "interleavedzb", "zbv", "dualpipev", "wpipe",
                                "custom")
ZERO_BUBBLE: tuple[str, ...] = ("interleavedzb", "zbv", "dualpipev")
# weight versions of the multi-stage schedules that keep more than one: WPipe's G0 (the first half of its 2W
# virtual stages) two, G1 one
MULTI_STAGE_VERSIONS: dict[str, Callable[[int, int], int]] = {"wpipe": lambda k, p: 2 if k < p // 2 else 1}
# the stage boundaries a schedule's moves keep where they are, each named by the stage after it: WPipe's
# between its groups (G0's last stage p/2 - 1 and G1's first p/2), which update at different points of a step
FIXED_BOUNDARIES: dict[str, Callable[[int], tuple[int, ...]]] = {"wpipe": lambda p: (p // 2,)}
_ZERO_BUBBLE_SHARE = 1 / 3  # of the interleaved bubble that a zero-bubble schedule keeps


class Code(IntEnum):
    """Policies as small integers, for numpy arrays indexed by execution position."""

    D = 0
    S = 1
    R = 2

    @classmethod
    def of(cls, policy: Policy) -> Code:
        return _CODE_OF[policy]

    def policy(self) -> Policy:
        return _POLICY_OF[self]


_CODE_OF = {Policy.KEEP: Code.D, Policy.SWAP: Code.S, Policy.RECOMPUTE: Code.R}
_POLICY_OF = {v: k for k, v in _CODE_OF.items()}


def check_schedule(schedule: str) -> str:
    if schedule not in RULES and schedule not in MULTI_STAGE:
        raise ValueError(
            f"unknown schedule {schedule!r}; expected one of {', '.join((*RULES, *MULTI_STAGE))}"
        )
    return schedule


def in_flight(schedule: str, stage: int, num_stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak."""
    check_schedule(schedule)
    if schedule in MULTI_STAGE:
        raise ValueError(f"{schedule} runs several stages per rank: its in-flight counts come "
                         "from its action lists (PipelineSetup(in_flight_counts=...))")
    return RULES[schedule].in_flight(stage, num_stages, micro_batches)


def streams(schedule: str) -> bool:
    """Whether ``schedule`` keeps micro-batches in flight across steps (no flush)."""
    rules = RULES.get(check_schedule(schedule))
    return rules is not None and rules.streams


def weight_versions(schedule: str, stage: int, num_stages: int) -> int:
    """Weight versions a stage keeps: PipeDream stashes one per in-flight micro-batch, 2BW two on every stage,
    WPipe two on G0's stages (the first half of its ``2W`` virtual stages) and one on G1's."""
    schedule = check_schedule(schedule)
    if schedule in RULES:
        return RULES[schedule].versions(stage, num_stages)
    return MULTI_STAGE_VERSIONS[schedule](stage, num_stages) if schedule in MULTI_STAGE_VERSIONS else 1


@dataclass(frozen=True)
class Hardware:
    """Links and training constants the cost model needs.

    ``copy_bytes_per_s`` is the device<->host copy link that swaps use (PCIe 4 x16 ~ 12 GB/s
    achieved); ``net_bytes_per_s`` the link between neighbouring stages; ``optimizer_factor``
    the optimizer state per parameter byte (2 for Adam's two moments, 1 for momentum SGD).
    ``copies_overlap``: swap copies run beside the compute (CUDA copy streams), so a stage
    takes the longer of the two; False where the copy runs on the compute thread (a CPU
    "device": a memcpy the step waits for), so its time adds to the compute.
    """

    copy_bytes_per_s: float = 12e9
    net_bytes_per_s: float = 10e9
    optimizer_factor: float = 2.0
    copies_overlap: bool = True

    def __post_init__(self) -> None:
        for what in ("copy_bytes_per_s", "net_bytes_per_s"):
            value = getattr(self, what)
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"hardware {what} must be a positive finite number, got {value}")
        if not (np.isfinite(self.optimizer_factor) and self.optimizer_factor >= 0):
            raise ValueError(f"hardware optimizer_factor must be >= 0, got {self.optimizer_factor}")


@dataclass(frozen=True)
class PipelineSetup:
    """The fixed facts of a pipeline a plan is made for."""

    num_stages: int
    schedule: str = "1f1b"
    micro_batches: int = 8
    hardware: Hardware = Hardware()
    in_flight_counts: tuple[int, ...] | None = None  # per stage, when the schedule's action lists give them
    stage_ranks: tuple[int, ...] | None = None  # the rank of every stage, when a rank runs several
    stage_speeds: tuple[float, ...] | None = None  # per stage, compute time relative to the reference device

    def __post_init__(self) -> None:
        check_schedule(self.schedule)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"number of stages must be a positive integer, got {self.num_stages!r}")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro-batches must be a positive integer, got {self.micro_batches!r}")
        for name in ("in_flight_counts", "stage_ranks"):
            values = getattr(self, name)
            if values is not None and (len(values) != self.num_stages or any(
                    not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values)):
                raise ValueError(f"{name} must give a non-negative integer for each of the "
                                 f"{self.num_stages} stages")
        if self.stage_speeds is not None and (len(self.stage_speeds) != self.num_stages or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not (np.isfinite(v) and v > 0)
                for v in self.stage_speeds)):
            raise ValueError("stage_speeds must give a positive finite factor for each of "
                             f"the {self.num_stages} stages, got {self.stage_speeds!r:.200}")
        if self.schedule in MULTI_STAGE and (self.in_flight_counts is None or self.stage_ranks is None):
            raise ValueError(f"{self.schedule} runs several stages per rank: give "
                             "in_flight_counts and stage_ranks")

    @property
    def uneven(self) -> bool:
        """Whether the stages' devices run at different speeds (the
        partitioners must price each stage apart)."""
        return self.stage_speeds is not None and len(set(self.stage_speeds)) > 1

    def speed(self, stage: int) -> float:
        """How much longer than the reference device stage ``stage`` takes for the same compute."""
        return 1.0 if self.stage_speeds is None else float(self.stage_speeds[stage])

    def speeds(self) -> np.ndarray:
        """Every stage's :meth:`speed`, as an array."""
        return np.array([self.speed(k) for k in range(self.num_stages)], dtype=float)

    @property
    def fixed_boundaries(self) -> tuple[int, ...]:
        """The stages whose first layer a plan keeps (the boundary before each stays where it is)."""
        rule = FIXED_BOUNDARIES.get(self.schedule)
        return () if rule is None else rule(self.num_stages)

    def in_flight(self, stage: int) -> int:
        if self.in_flight_counts is not None:
            return max(1, self.in_flight_counts[stage])
        return in_flight(self.schedule, stage, self.num_stages, self.micro_batches)

    def stages_per_rank(self, stage: int) -> int:
        """How many stages share stage ``stage``'s rank (and its device budget)."""
        if self.stage_ranks is None:
            return 1
        return self.stage_ranks.count(self.stage_ranks[stage])

    def param_factor(self, stage: int) -> float:
        """Bytes held per parameter byte: weight versions plus optimizer state."""
        return weight_versions(self.schedule, stage, self.num_stages) + self.hardware.optimizer_factor

    def step_time(self, stage_times: Sequence[float] | np.ndarray) -> float:
        return pipeline_step_time(stage_times, self.schedule, self.micro_batches, self.stage_ranks)

    def budgets(self, memory_budget: int | float | Sequence[int | float] | None) -> np.ndarray:
        """Per-stage memory limits as an array (``inf`` where there is none)."""
        p = self.num_stages
        if memory_budget is None:
            return np.full(p, np.inf)
        if isinstance(memory_budget, bool):  # an int to Python, but never a number of bytes
            raise TypeError(
                f"memory budget must be a number of bytes or one per stage, got {memory_budget!r}"
            )
        if isinstance(memory_budget, (int, float, np.integer, np.floating)):
            # a rank's budget, shared equally by the stages it runs
            values = [float(memory_budget) / self.stages_per_rank(k) for k in range(p)]
        else:
            values = [float(v) for v in memory_budget]
            if len(values) != p:
                raise ValueError(f"got {len(values)} memory budgets for {p} stages")
        for k, v in enumerate(values):
            if not v >= 0:
                raise ValueError(
                    f"memory budget of stage {k} must be a non-negative number of bytes, got {v}"
                )
        return np.array(values, dtype=float)


def pipeline_step_time(stage_times: Sequence[float] | np.ndarray, schedule: str, micro_batches: int,
                       stage_ranks: Sequence[int] | None = None) -> float:
    """Seconds for one training step of ``micro_batches`` micro-batches, bubble included."""
    check_schedule(schedule)
    times = np.asarray(stage_times, dtype=float)
    if times.size == 0:
        raise ValueError("a pipeline needs at least one stage")
    slowest = float(times.max())
    if schedule in MULTI_STAGE:
        if stage_ranks is None or len(stage_ranks) != times.size:
            raise ValueError(f"{schedule} needs the rank of each of its {times.size} stages")
        ranks = np.asarray(stage_ranks)
        per_rank = np.bincount(ranks, weights=times)
        bubble = (per_rank.size - 1) * slowest * (_ZERO_BUBBLE_SHARE if schedule in ZERO_BUBBLE else 1.0)
        return micro_batches * float(per_rank.max()) + bubble
    if RULES[schedule].streams:
        return micro_batches * slowest
    return float(times.sum()) + (micro_batches - 1) * slowest


def throughput(stage_times: Sequence[float] | np.ndarray, schedule: str, micro_batches: int,
               stage_ranks: Sequence[int] | None = None) -> float:
    """Micro-batches per second in steady state."""
    return micro_batches / pipeline_step_time(stage_times, schedule, micro_batches, stage_ranks)
