"""The user's configuration resolved on this rank at attach: what its
options mean on this device and pipeline.

``memory_budget="auto"`` becomes bytes of this rank's GPU; the daemon's planner gets the pipeline's
shape (schedule, micro-batches, in-flight counts, stage ranks) next to ``planner_options``. The
configuration itself is :mod:`vpipe.config`'s, torch-free; what needs torch or the pipeline is here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vpipe.config import AUTO_BUDGET, VpipeConfig
from vpipe.planner import DEFAULT_PLANNER
from vpipe.planner.online import OnlineConfig

if TYPE_CHECKING:
    from vpipe.stage.pipeline import Pipeline

__all__ = ["resolve_memory_budget", "planner_config"]

_DEVICE_MARGIN = 0.08  # of a GPU's memory left to the CUDA context, the allocator's cache and fragmentation
_DEVICE_MARGIN_MIN = 1 << 30


def resolve_memory_budget(budget: int | str | None, device: torch.device) -> int | None:
    """Bytes for ``budget``: "auto" is the GPU's capacity minus a margin; a CPU stage has no device limit."""
    if budget != AUTO_BUDGET:
        return budget  # type: ignore[return-value]
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return total - max(_DEVICE_MARGIN_MIN, int(total * _DEVICE_MARGIN))


def planner_config(config: VpipeConfig, pipeline: Pipeline, memory_budget: int | None,
                   allow_moves: bool) -> dict[str, Any] | None:
    """What the daemon's planner is configured with: for the default planner, the pipeline's shape and
    ``planner_options`` (checked here, at attach); another planner gets ``planner_options`` as given."""
    if config.planner != DEFAULT_PLANNER:
        return dict(config.planner_options) or None
    shape = {"schedule": pipeline.kind, "micro_batches": pipeline.micro_batches(config.micro_batches),
             "memory_budget": memory_budget, "allow_moves": allow_moves, "in_flight": pipeline.in_flight(),
             "in_flight_together": pipeline.in_flight_together(),
             "stage_ranks": list(pipeline.stage_ranks) if pipeline.multi_stage else None}
    taken = sorted(set(shape) & set(config.planner_options))
    if taken:
        raise ValueError(f"vpipe config: planner_options cannot set {', '.join(taken)}: "
                         "attach reads them off the pipeline")
    return OnlineConfig.from_mapping({**shape, **config.planner_options}).to_dict()
