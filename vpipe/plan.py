"""A plan: which stage holds which layers, and what happens to each layer's activations.

Plans are made by the planner, travel over the control plane (as plain msgpack-able
dicts, see :meth:`Plan.to_wire`), and are applied by the tensor managers (policies) and
the layer managers (placement). Every plan that enters from outside goes through
:meth:`Plan.from_wire`, which rejects anything malformed with a message naming the fault.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Policy", "Plan", "PlanError", "PINNED_KIND", "MAX_EPOCH_STEP"]

# the end of a block kind (as the monitors report it) whose block never
# moves: no plan puts it on another stage
PINNED_KIND = "!pinned"

# plans come one epoch (or a few layer edits) after another: a larger jump is not a plan, and one epoch of
# 2**63-1 would make every later plan stale (checked by the daemon before it sends, and by every stage)
MAX_EPOCH_STEP = 1000


class Policy(str, Enum):
    """What a layer's saved activations do between its forward and its backward."""

    KEEP = "D"  # stay on the device
    SWAP = "S"  # copied to pinned host memory, prefetched back before the backward
    RECOMPUTE = "R"  # dropped, the layer's forward runs again in the backward

    @classmethod
    def parse(cls, value: Any) -> Policy:
        try:
            return cls(value)
        except ValueError:
            raise PlanError(f"unknown policy {value!r}; expected one of D, S, R") from None


class PlanError(ValueError):
    """A plan that cannot be applied (malformed, stale, or naming unknown layers/stages)."""


@dataclass(frozen=True)
class Plan:
    epoch: int
    stages: tuple[tuple[int, ...], ...]
    policies: Mapping[int, Policy] = field(default_factory=dict)
    predicted_step_s: float | None = None
    reason: str = ""
    # how much longer than the fastest stage each stage takes for the same blocks, as the planner measured it
    stage_speeds: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 0:
            raise PlanError(f"plan epoch must be a non-negative integer, got {self.epoch!r}")
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        seen: set[int] = set()
        for s, layers in enumerate(self.stages):
            if not layers:
                raise PlanError(f"stage {s} of the plan has no layers")
            for lid in layers:
                if not isinstance(lid, int) or isinstance(lid, bool) or lid < 0:
                    raise PlanError(f"stage {s}: layer id {lid!r} is not a non-negative integer")
                if lid in seen:
                    raise PlanError(f"layer {lid} is placed twice")
                seen.add(lid)
        unknown = sorted(set(self.policies) - seen)
        if unknown:
            raise PlanError(f"policies name layers the plan does not place: {unknown[:5]}")
        for lid, pol in self.policies.items():
            if not isinstance(pol, Policy):
                raise PlanError(f"layer {lid}: policy {pol!r} is not a Policy")
        if self.predicted_step_s is not None and not (
            math.isfinite(self.predicted_step_s) and self.predicted_step_s >= 0
        ):
            raise PlanError(f"predicted step time must be finite and >= 0, got {self.predicted_step_s}")
        if self.stage_speeds is not None and (len(self.stage_speeds) != len(self.stages) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v)
                                                                               and 0 < v <= 1e6)
                for v in self.stage_speeds)):
            raise PlanError("plan stage_speeds must be one factor in (0, 1e6] per stage "
                            f"({len(self.stages)}), got {self.stage_speeds!r:.120}")

    # ----------------------------------------------------------------- queries
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def layer_ids(self) -> list[int]:
        return [lid for layers in self.stages for lid in layers]

    def stage_of(self, layer_id: int) -> int:
        for s, layers in enumerate(self.stages):
            if layer_id in layers:
                return s
        raise PlanError(f"layer {layer_id} is not in the plan")

    def policy(self, layer_id: int) -> Policy:
        return self.policies.get(layer_id, Policy.KEEP)

    def counts(self) -> list[int]:
        return [len(layers) for layers in self.stages]

    def check_against(self, layer_order: Iterable[int], num_stages: int) -> None:
        """Reject a plan that does not cover exactly ``layer_order`` as ``num_stages`` contiguous runs."""
        order = list(layer_order)
        if self.num_stages != num_stages:
            raise PlanError(f"plan has {self.num_stages} stages, the pipeline has {num_stages}")
        missing = sorted(set(order) - set(self.layer_ids))
        extra = sorted(set(self.layer_ids) - set(order))
        if extra:
            raise PlanError(f"plan names unknown layers {extra[:5]}")
        if missing:
            raise PlanError(f"plan leaves layers {missing[:5]} unplaced")
        if self.layer_ids != order:
            raise PlanError("plan reorders layers: every stage must hold a contiguous run "
                            "of the model's layers")

    # ----------------------------------------------------------------- wire format
    def to_wire(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "stages": [list(layers) for layers in self.stages],
            "policies": {str(k): v.value for k, v in sorted(self.policies.items())},
            "predicted_step_s": self.predicted_step_s,
            "reason": self.reason,
            **({} if self.stage_speeds is None else {"stage_speeds": list(self.stage_speeds)}),
        }

    @classmethod
    def from_wire(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a map, got {type(data).__name__}")
        for key in ("epoch", "stages"):
            if key not in data:
                raise PlanError(f"plan is missing {key!r}")
        stages = data["stages"]
        if not isinstance(stages, list) or not all(isinstance(s, list) for s in stages):
            raise PlanError("plan 'stages' must be a list of lists of layer ids")
        raw_policies = data.get("policies", {})
        if not isinstance(raw_policies, dict):
            raise PlanError("plan 'policies' must be a map from layer id to D/S/R")
        policies: dict[int, Policy] = {}
        for key, value in raw_policies.items():
            try:
                lid = int(key)
            except (TypeError, ValueError, OverflowError):
                raise PlanError(f"policy key {key!r} is not a layer id") from None
            policies[lid] = Policy.parse(value)
        predicted = data.get("predicted_step_s")
        if predicted is not None and (not isinstance(predicted, (int, float)) or isinstance(predicted, bool)):
            raise PlanError("plan 'predicted_step_s' must be a number")
        if isinstance(predicted, int) and abs(predicted) > 1 << 53:
            raise PlanError("plan 'predicted_step_s' is out of range (more than 2**53 seconds)")
        reason = data.get("reason", "")
        if not isinstance(reason, str):
            raise PlanError("plan 'reason' must be a string")
        speeds = data.get("stage_speeds")
        if speeds is not None and not isinstance(speeds, list):
            raise PlanError("plan 'stage_speeds' must be a list of numbers, one per stage")
        return cls(
            epoch=data["epoch"],
            stages=tuple(tuple(layers) for layers in stages),
            policies=policies,
            predicted_step_s=None if predicted is None else float(predicted),
            reason=reason,
            stage_speeds=None if speeds is None else tuple(speeds),
        )

    @classmethod
    def from_counts(cls, layer_ids: Iterable[int], counts: Iterable[int], epoch: int = 0) -> Plan:
        ids = list(layer_ids)
        stages, start = [], 0
        for c in counts:
            stages.append(tuple(ids[start:start + c]))
            start += c
        if start != len(ids):
            raise PlanError(f"stage sizes cover {start} layers, there are {len(ids)}")
        return cls(epoch=epoch, stages=tuple(stages))
