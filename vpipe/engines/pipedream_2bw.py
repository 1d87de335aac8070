"""vpipe's own ``SchedulePipeDream2BW``: a PipeDream stream that
updates once per period on two weight versions."""

from __future__ import annotations

from typing import Any

from vpipe.engines.base import Engine, EngineKind
from vpipe.engines.pipedream import PipeDreamEngine
from vpipe.engines.torch_single import read_single_stage
from vpipe.schedules.pipedream_2bw import SchedulePipeDream2BW

__all__ = ["PipeDream2BWEngine"]


class PipeDream2BWEngine(PipeDreamEngine):
    """A stream like PipeDream's (micro-batches in flight across steps, no flush), with two weight versions
    per stage and a gradient accumulated over each step's micro-batches. Moves are streamed as under PipeDream
    (same rules for the stage's shape), switching at a period's start: the schedule says which versions travel
    and after which update the live state is handed over."""

    kind = EngineKind.PIPEDREAM_2BW
    carry_refusal = "is not supported under SchedulePipeDream2BW (its streamed moves do not carry averages)"
    replica_refusal = ("a PipeDream-2BW stream with data-parallel replicas is not supported; run one "
                       "pipeline over the whole world, or use GPipe / 1F1B / the multi-stage schedules")

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return isinstance(target, SchedulePipeDream2BW)

    @classmethod
    def read(cls, target: Any) -> Engine:
        return cls(read_single_stage(target, "pipedream2bw"))

    def weight_versions(self, stage: int) -> int:
        return 2

    def unsettled(self) -> str | None:
        in_flight = self.pipeline.schedule.in_flight
        if in_flight:
            n = len(in_flight)
            return (f"a PipeDream-2BW stream needs schedule.flush() first "
                    f"({n} micro-batch{'es' if n > 1 else ''} in flight)")
        return None
