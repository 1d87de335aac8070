"""vpipe: virtualized activation memory and live layer placement for pipeline-parallel PyTorch.

The public API::

    vp = vpipe.attach(schedule, optimizer=opt)     # the one line (see vpipe.attach)
    vpipe.Plan, vpipe.Policy                       # placements and keep/swap/recompute policies
    vpipe.VpipeConfig                              # every option of attach, validated
    vpipe.SchedulePipeDream                        # asynchronous 1F1B with weight stashing
    vpipe.global_block_keys, vpipe.local_block_keys  # DCP keys for stages that number blocks locally

Names are imported on first use, so light commands (``vpipe logs``) do not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "attach": "vpipe.attach",
    "Vpipe": "vpipe.attach",
    "VpipeConfig": "vpipe.attach",
    "Plan": "vpipe.plan",
    "Policy": "vpipe.plan",
    "SchedulePipeDream": "vpipe.schedules.pipedream",
    "global_block_keys": "vpipe.checkpoint.block_keys",
    "local_block_keys": "vpipe.checkpoint.block_keys",
}
__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
