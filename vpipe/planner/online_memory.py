"""What the live planner needs to know of memory: the share of its saved bytes each layer costs, each stage's
part of its rank's budget (from the stages' measured records)."""

from __future__ import annotations

from typing import Any

from vpipe.graph import LayerGraph
from vpipe.monitors.records import StageRecord
from vpipe.plan import Plan
from vpipe.sharing import keep_all_shares

__all__ = ["kept_shares", "shared_budgets"]


def kept_shares(vector: list[StageRecord]) -> dict[int, float]:
    """Per layer, the share of its saved bytes that keeping it costs its stage.

    Two layers of a stage may save one tensor (a layer's output is its successor's input):
    their ``activation_bytes`` summed count it twice, which would make the planner think a
    stage that fits with every layer kept does not, and swap for nothing. A stage that
    measured what a micro-batch keeps, each storage once (``kept_bytes_per_mb``), scales its
    layers by that over their sum; the model is then exact for the running placement. A stage
    that has not measured it keeps 1 (the sum, which never underestimates).
    """
    shares: dict[int, float] = {}
    for rec in vector:
        total = sum(lr.activation_bytes for lr in rec.layers)
        share = min(1.0, rec.kept_bytes_per_mb / total) if rec.kept_bytes_per_mb and total else 1.0
        shares.update((lr.layer_id, share) for lr in rec.layers)
    return shares


def shared_budgets(budget: int, setup: Any, graph: LayerGraph, current: Plan, vector: list[StageRecord],
                    together: list[list[int]] | None = None) -> int | list[float]:
    """Each stage's part of its rank's budget, as the ranks share it (``vpipe.rank.memory``).

    A rank pays its stages' weights, gradients and optimizer state first and shares the rest
    as :func:`vpipe.sharing.keep_all_shares` does: when the rank's peak with every layer kept
    (its stages' micro-batches in flight at each moment of the action lists, ``together``,
    times one micro-batch's measured bytes) fits, each stage gets at least its own peak.
    Otherwise, and until every stage has measured its bytes, the shares are equal (as
    :meth:`PipelineSetup.budgets` divides a rank's budget).
    """
    kept = [rec.kept_bytes_per_mb for rec in vector]
    if not all(kept) or len(kept) != current.num_stages:
        return budget
    params = {node.id: node.param_bytes for node in graph.nodes}
    fixed = [setup.param_factor(k) * sum(params[lid] for lid in layers)
             for k, layers in enumerate(current.stages)]
    ranks = setup.stage_ranks
    shares = []
    for k in range(current.num_stages):
        mates = [j for j in range(current.num_stages) if ranks[j] == ranks[k]]
        left = budget - sum(fixed[j] for j in mates)
        part = keep_all_shares(left, [kept[j] for j in mates], [setup.in_flight(j) for j in mates], together,
                               mates)
        shares.append(fixed[k] + part[mates.index(k)] if part is not None else budget / len(mates))
    return shares
