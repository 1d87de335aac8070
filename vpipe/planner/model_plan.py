"""A plan in the model's own terms: module names per stage, a ``split_spec``, layers per stage.

The planner works on node ids; a user with a model needs what to type into a trainer:

- the module names each stage holds, and each one's keep (D) / swap (S) / recompute (R) policy;
- ``split_spec`` for ``torch.distributed.pipelining.pipeline``: ``{name: SplitPoint.BEGINNING}``
  for the first module of every stage but the first;
- for a manual split (the tutorial's ``split_model``, a ``ModuleList`` slice per stage), how
  many blocks of each container every stage holds;
- what the cost model predicts: step time, each stage's time and peak memory, and what
  makes the slowest stage slow (compute, boundary transfers, swaps the copy link cannot hide).

Torch-free: it reads the graph, the units and the plan, never the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vpipe.graph import LayerGraph, ModelGraph
from vpipe.plan import Policy
from vpipe.planner.cost_model import GraphProfile, Hardware
from vpipe.planner.srp import PlanResult

__all__ = ["ModelPlan", "model_plan"]


@dataclass(frozen=True)
class ModelPlan:
    """What ``vpipe plan --model`` prints."""

    stages: list[list[str]]
    policies: dict[str, str]
    split_spec: dict[str, str]
    layer_counts: dict[str, list[int]]
    stage_s: list[float]
    stage_memory_bytes: list[float]
    step_s: float
    bottleneck_stage: int
    bottleneck: dict[str, float]  # seconds: total, compute, transfers, swaps
    comm_bytes: int
    planner_s: float
    method: str

    def summary(self) -> dict[str, Any]:
        """The ``--json`` object: the graph plan's keys, in module names, plus the model's extras."""
        return {
            "stages": self.stages,
            "policies": self.policies,
            "bottleneck_ms": self.bottleneck["total"] * 1e3,
            "comm_bytes": self.comm_bytes,
            "planner_s": self.planner_s,
            "split_spec": self.split_spec,
            "layer_counts": self.layer_counts,
            "step_ms": self.step_s * 1e3,
            "stage_ms": [t * 1e3 for t in self.stage_s],
            "stage_memory_bytes": [int(math.ceil(m)) for m in self.stage_memory_bytes],
            "bottleneck_stage": self.bottleneck_stage,
            "bottleneck_parts_ms": {k: v * 1e3 for k, v in self.bottleneck.items() if k != "total"},
        }

    def split_spec_text(self) -> str:
        """``split_spec`` as Python to paste (``from torch.distributed.pipelining import SplitPoint``)."""
        inner = ", ".join(f"{name!r}: SplitPoint.BEGINNING" for name in self.split_spec)
        return "{" + inner + "}"


def model_plan(model_graph: ModelGraph, result: PlanResult, hardware: Hardware | None = None) -> ModelPlan:
    """Translate ``result`` (a plan of ``model_graph.graph``) into module names."""
    graph, units = model_graph.graph, model_graph.units
    by_id = {node.id: units[i] for i, node in enumerate(graph.nodes)}
    stages = [[by_id[lid].name for lid in layers] for layers in result.stages]
    policies = {by_id[lid].name: result.policies[lid].value for layers in result.stages for lid in layers}
    split_spec = {names[0]: "BEGINNING" for names in stages[1:]}
    counts = {c: [sum(1 for lid in layers if by_id[lid].container == c) for layers in result.stages]
              for c in model_graph.containers}
    k = max(range(len(result.stage_times_s)), key=lambda s: result.stage_times_s[s])
    return ModelPlan(
        stages=stages, policies=policies, split_spec=split_spec, layer_counts=counts,
        stage_s=list(result.stage_times_s), stage_memory_bytes=list(result.stage_memory_bytes),
        step_s=result.step_s, bottleneck_stage=k,
        bottleneck=_parts(graph, result, k, hardware or Hardware()),
        comm_bytes=result.comm_bytes, planner_s=result.planner_s, method=result.method)


def _parts(graph: LayerGraph, result: PlanResult, k: int, hardware: Hardware) -> dict[str, float]:
    """The slowest stage's time, split into compute (recompute included), transfers and exposed swaps."""
    profile = GraphProfile(graph)
    start = sum(len(s) for s in result.stages[:k])
    end = start + len(result.stages[k])
    compute = 0.0
    for i in range(start, end):
        node = graph.nodes[i]
        compute += node.fwd_s + node.bwd_s
        if result.policies[node.id] is Policy.RECOMPUTE:
            compute += node.fwd_s
    transfers = float(profile.cut[start] + profile.cut[end]) / hardware.net_bytes_per_s
    total = result.stage_times_s[k]
    swaps = total - compute - transfers
    return {"total": total, "compute": compute, "transfers": transfers,
            "swaps": swaps if swaps > 1e-9 * total else 0.0}  # not rounding noise
