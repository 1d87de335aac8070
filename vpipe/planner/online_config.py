"""What the online planner is told about the pipeline, as data: checked where it enters the daemon.

``vpipe.attach`` fills :class:`OnlineConfig` from the pipeline it attached to (schedule,
micro-batches, budget, in-flight counts) and the user's ``planner_options``; the daemon
receives it as ``--planner-config JSON`` and builds it with :meth:`OnlineConfig.from_mapping`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from vpipe.checks import require
from vpipe.planner.cost_model import MULTI_STAGE, SCHEDULES

__all__ = ["OnlineConfig", "as_tuple"]

_WHAT = "planner config"  # how errors name the configuration


@dataclass(frozen=True)
class OnlineConfig:
    """How the online planner judges the pipeline (all validated on construction)."""

    schedule: str = "1f1b"
    micro_batches: int = 8
    # per stage: parameters, gradients, optimizer state and saved activations
    memory_budget: int | None = None
    horizon_steps: int = 500
    min_gain: float = 0.05
    cooldown_steps: int = 10
    smoothing: float = 0.5  # weight of the newest sample in the per-layer average
    warmup_samples: int = 2  # samples to see before the first plan
    imbalance_threshold: float = 0.10  # slowest stage over mean stage time that counts as imbalance
    # a plan made for speed is sent once it was worth sending on this many samples in a row (proposed, then
    # proposed again or still worth its move): one noisy sample on a busy machine cannot move layers (plans to
    # fit memory or follow an edit go at once)
    confirm_samples: int = 2
    allow_moves: bool = True  # False: only swap/recompute policies change (no layer factory)
    copy_bytes_per_s: float = 12e9
    net_bytes_per_s: float = 10e9
    # several stages per rank: each stage's peak in-flight micro-batches and rank, from
    # the schedule's action lists, and the micro-batches every stage holds at each
    # moment of them (a rank's stages do not peak at once)
    in_flight: list[int] | None = None
    stage_ranks: list[int] | None = None
    in_flight_together: list[list[int]] | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            require(ok, f"{_WHAT}: {message}")

        known = SCHEDULES + MULTI_STAGE
        need(self.schedule in known, f"schedule must be one of {', '.join(known)}, got {self.schedule!r}")
        for name in ("in_flight", "stage_ranks"):
            values = getattr(self, name)
            need(values is None or (isinstance(values, list) and all(_count(v) for v in values)),
                 f"{name} must be a list of non-negative integers or null, got {values!r}")
        need((self.in_flight is None) == (self.stage_ranks is None) and (
            self.in_flight is None or len(self.in_flight) == len(self.stage_ranks)),  # type: ignore[arg-type]
            "in_flight and stage_ranks come together, one value per stage")
        rows = self.in_flight_together
        need(rows is None or (self.in_flight is not None and isinstance(rows, list) and all(
            isinstance(row, list) and len(row) == len(self.in_flight) and all(_count(v) for v in row)
            for row in rows)),
             "in_flight_together must be null or rows of one non-negative integer per stage, with in_flight, "
             f"got {rows!r}")
        need(self.schedule not in MULTI_STAGE or self.in_flight is not None,
             f"schedule {self.schedule} runs several stages per rank: in_flight and stage_ranks are needed")
        need(_pos_int(self.micro_batches),
             f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        need(self.memory_budget is None or _pos_int(self.memory_budget),
             f"memory_budget must be a positive number of bytes or null, got {self.memory_budget!r}")
        need(_pos_int(self.horizon_steps),
             f"horizon_steps must be a positive integer, got {self.horizon_steps!r}")
        need(0.0 <= self.min_gain < 1.0, f"min_gain must be in [0, 1), got {self.min_gain!r}")
        need(isinstance(self.cooldown_steps, int) and self.cooldown_steps >= 0,
             f"cooldown_steps must be >= 0, got {self.cooldown_steps!r}")
        need(0.0 < self.smoothing <= 1.0, f"smoothing must be in (0, 1], got {self.smoothing!r}")
        need(isinstance(self.warmup_samples, int) and self.warmup_samples >= 1,
             f"warmup_samples must be >= 1, got {self.warmup_samples!r}")
        need(_pos_int(self.confirm_samples),
             f"confirm_samples must be a positive integer, got {self.confirm_samples!r}")
        need(self.imbalance_threshold >= 0,
             f"imbalance_threshold must be >= 0, got {self.imbalance_threshold!r}")
        need(self.copy_bytes_per_s > 0 and self.net_bytes_per_s > 0, "bandwidths must be positive")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> OnlineConfig:
        """The configuration a JSON object describes (``to_dict``'s
        output); ValueError naming what is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{_WHAT} must be a JSON object of OnlineConfig fields, got "
                             f"{type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(key) for key in set(data) - known)
        if unknown:
            raise ValueError(f"{_WHAT} has unknown keys: {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:  # a value of the wrong kind met a comparison: "'<=' not supported ..."
            raise ValueError(f"{_WHAT}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: what ``from_mapping`` reads back."""
        return asdict(self)


def as_tuple(values: list[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


def _count(value: Any) -> bool:
    """A non-negative integer (not a bool, not a float that happens to be whole)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
