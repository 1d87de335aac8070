"""The global planner: cost model, optimize_sr (Alg. 2), partition (Alg. 3), SRP loop (Alg. 1).

Entry points, loaded on first use so that importing a light part of the package (the
planner daemon imports :mod:`vpipe.planner.judge`) does not pull in numpy:

- :func:`plan_pipeline` plans a :class:`~vpipe.graph.LayerGraph` offline (``vpipe plan``);
- :class:`SRPPlanner` turns live statistics into :class:`Proposal` s for the planner daemon;
- :class:`Hardware` holds the link bandwidths and optimizer factor the cost model uses.

:data:`DEFAULT_PLANNER` names the function a run's planner daemon calls unless the run
names another: the online SRP planner.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "plan_pipeline": "vpipe.planner.srp",
    "PlanResult": "vpipe.planner.srp",
    "SRPPlanner": "vpipe.planner.proposals",
    "Proposal": "vpipe.planner.proposals",
    "InfeasibleError": "vpipe.planner.cuts",
    "Hardware": "vpipe.planner.cost_model",
    "optimize_sr": "vpipe.planner.sr",
}

# the planner function (module:function) a run's daemon calls unless the run names another
DEFAULT_PLANNER = "vpipe.planner.online:srp"

__all__ = sorted(_EXPORTS) + ["DEFAULT_PLANNER"]


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'vpipe.planner' has no attribute {name!r}") from None
    return getattr(import_module(module), name)
