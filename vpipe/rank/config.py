"""The old home of :class:`~vpipe.config.VpipeConfig` (now :mod:`vpipe.config`, and
``vpipe.VpipeConfig``) and of what attach resolves from it (now :mod:`vpipe.rank.resolved`):
``from vpipe.rank.config import VpipeConfig`` keeps working."""

from __future__ import annotations

from vpipe.config import AUTO_BUDGET, VpipeConfig
from vpipe.rank.resolved import planner_config, resolve_memory_budget

__all__ = ["VpipeConfig", "AUTO_BUDGET", "resolve_memory_budget", "planner_config"]
