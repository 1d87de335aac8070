"""The planner function a daemon runs: loaded from ``--planner``, configured, and its plans checked.

The planner daemon plans with any function ``planner(vector, current) -> Plan | None`` named by
an import path (``--planner MODULE:FUNCTION``), and takes its configuration as data
(``--planner-config``: a JSON object, checked for shape here and for its fields by the planner's
own ``configured(config)``, which returns the function to call). Whatever such a function
returns is checked here before any stage sees it (:func:`plan_problem`). Apart from the daemon
because this is the daemon's contract with code it does not know, the same whoever calls it,
while the daemon is its sockets, its loop and what it sends.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any, cast

from vpipe.monitors.records import StageRecord
from vpipe.plan import MAX_EPOCH_STEP, Plan, PlanError

__all__ = ["PlannerFn", "MAX_PLANNER_CONFIG_CHARS", "parse_planner_config", "load_planner", "plan_problem"]

PlannerFn = Callable[[list[StageRecord], "Plan | None"], "Plan | None"]
MAX_PLANNER_CONFIG_CHARS = 1 << 20  # a pipeline's shape is kilobytes; beyond this it is a mistake


def parse_planner_config(text: str) -> dict[str, Any]:
    """``--planner-config``: a JSON object, checked for shape here (its fields by the planner)."""
    if len(text) > MAX_PLANNER_CONFIG_CHARS:
        raise ValueError(f"--planner-config is {len(text)} characters, over the "
                         f"{MAX_PLANNER_CONFIG_CHARS} allowed")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--planner-config is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(
            "--planner-config nests its JSON too deeply to be a planner's configuration"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"--planner-config must be a JSON object, got {type(config).__name__}")
    return config


def load_planner(spec: str, config: dict[str, Any] | None = None) -> PlannerFn:
    """The function named by ``module:function``, made with ``config``
    when given; ValueError naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"a planner must be given as module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import planner module {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    if config is None:
        return cast(PlannerFn, fn)
    configured = getattr(fn, "configured", None)
    if not callable(configured):
        raise ValueError(f"planner {spec} takes no configuration: it has no configured(config) "
                         "for --planner-config")
    planner = configured(config)
    if not callable(planner):
        raise ValueError(f"{spec}.configured(config) returned {type(planner).__name__}, "
                         "not a planner function")
    return cast(PlannerFn, planner)


def plan_problem(plan: Any, current: Plan | None, num_stages: int | None,
                 layer_order: list[int]) -> str | None:
    """Why ``plan``, returned by a planner while ``current`` is in force on a pipeline of
    ``num_stages`` (None: not known yet), cannot go to the stages; None when it can."""
    if not isinstance(plan, Plan):
        return f"expected a Plan or None, got {type(plan).__name__}"
    epoch = current.epoch if current is not None else 0
    if current is not None and plan.epoch <= epoch:
        return f"epoch {plan.epoch} is not newer than the current epoch {epoch}"
    # the stages would drop it, and every plan after it be stale here
    if plan.epoch > epoch + MAX_EPOCH_STEP:
        return f"epoch {plan.epoch} jumps more than {MAX_EPOCH_STEP} past the current epoch {epoch}"
    if num_stages is not None and plan.num_stages != num_stages:
        return f"{plan.num_stages} stages for a {num_stages}-stage pipeline"
    try:
        plan.check_against(layer_order, plan.num_stages)  # the layers the stages just reported, in order
    except PlanError as e:
        return str(e)
    return None
