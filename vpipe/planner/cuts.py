"""What every partitioner shares: a partition as cut positions, per-stage costs that add up, memory.

A stage is a contiguous run of the execution order, so a partition into ``p`` stages is
``p - 1`` cut positions (:class:`Partition`). The exact DP (:mod:`vpipe.planner.exact`),
the coarsened search (:mod:`vpipe.planner.partition`), its bisection and refinement, and
the SRP loop all speak these types; a partitioner that finds no split within the memory
limits raises :class:`InfeasibleError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from vpipe.planner.cost_model import StageCosts

__all__ = ["Partition", "InfeasibleError", "Additive", "CommBytes", "MemoryMode", "check_layers_fit",
           "partition_from_dp"]

# how a stage's memory is priced: "fixed" on the layers' policies as they are, "best_case" each on the policy
# that holds least
MemoryMode = Literal["fixed", "best_case"]


class InfeasibleError(ValueError):
    """No partition satisfies the memory limits; the message names the culprit when it can."""


@dataclass(frozen=True)
class Partition:
    """A contiguous partition: cut positions, its slowest stage, and its secondary cost."""

    cuts: tuple[int, ...]
    bottleneck_s: float
    secondary: float = 0.0


def partition_from_dp(costs: StageCosts, parents: list[np.ndarray], value: np.ndarray, secondary: bool
                      ) -> Partition | None:
    """The partition a DP over (stage, end) found: ``parents[k][j]`` is where stage ``k`` ending at ``j``
    starts, ``value[n]`` the objective of the whole (inf: none fits); priced by ``costs``."""
    n = costs.n
    if not np.isfinite(value[n]):
        return None
    cuts, j = [], n
    for k in range(len(parents) - 1, 0, -1):
        j = int(parents[k][j])
        cuts.append(j)
    cuts.reverse()
    return Partition(tuple(cuts), float(costs.stage_times(cuts).max()), float(value[n]) if secondary else 0.0)


class Additive(Protocol):
    """A per-stage cost that is a sum over the stage: ``end[j] + start[i]`` for stage ``[i, j)``."""

    def terms(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """``(end, start)`` arrays of length ``n + 1`` for stage number ``stage``."""
        ...


class CommBytes:
    """Boundary bytes as an :class:`Additive` cost: each stage but the first pays its start's bytes."""

    def __init__(self, costs: StageCosts) -> None:
        self._cut = costs.cut
        self._zero = np.zeros_like(self._cut)

    def terms(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        return self._zero, (self._cut if stage > 0 else self._zero)


def check_layers_fit(costs: StageCosts, budgets: np.ndarray, memory: MemoryMode = "best_case") -> None:
    """Raise :class:`InfeasibleError` naming the first layer that fits no stage it could sit in."""
    if not np.isfinite(budgets).any():
        return
    n, p = costs.n, len(budgets)
    idx = np.arange(n)
    fits_somewhere = np.zeros(n, dtype=bool)
    least = np.full(n, np.inf)  # smallest need over the stages a layer may sit in
    least_budget = np.zeros(n)
    for k in range(p):
        allowed = (idx >= k) & (n - idx >= p - k)  # earlier and later stages must stay non-empty
        prefix = costs.memory_prefix(k, memory == "best_case")
        alone = prefix[1:] - prefix[:-1]
        fits_somewhere |= allowed & (alone <= budgets[k])
        lower = allowed & (alone < least)
        least = np.where(lower, alone, least)
        least_budget = np.where(lower, budgets[k], least_budget)
    bad = np.flatnonzero(~fits_somewhere)
    if bad.size:
        i = int(bad[0])
        node = costs.profile.graph.nodes[i]
        raise InfeasibleError(
            f"infeasible: layer {node.id} ({node.name}) needs {int(np.ceil(least[i]))} bytes "
            f"> budget {int(least_budget[i])}"
        )
