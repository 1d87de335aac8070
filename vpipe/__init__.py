"""vpipe: virtualized activation memory and live layer placement for pipeline-parallel PyTorch.

The public API::

    vp = vpipe.attach(schedule, optimizer=opt)     # the one line (see vpipe._attach) vpipe.Plan,
    vpipe.Policy                       # placements and keep/swap/recompute policies vpipe.VpipeConfig
    # every option of attach, validated vpipe.SchedulePipeDream                        # asynchronous
    1F1B with weight stashing vpipe.SchedulePipeDream2BW                     # PipeDream-2BW: 1F1B, two
    weight versions, one update a step vpipe.ScheduleWPipe                            # WPipe: two
    stages a rank, groups G0/G1 updated alternately vpipe.global_block_keys, vpipe.local_block_keys  #
    DCP keys for stages that number blocks locally

Names are imported on first use, so light commands (``vpipe logs``) do not load torch; the
``TYPE_CHECKING`` imports below show a type checker the same names with their real types.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vpipe._attach import Vpipe, attach
    from vpipe.checkpoint.block_keys import global_block_keys, local_block_keys
    from vpipe.config import VpipeConfig
    from vpipe.plan import Plan, Policy
    from vpipe.schedules.pipedream import SchedulePipeDream
    from vpipe.schedules.pipedream_2bw import SchedulePipeDream2BW
    from vpipe.schedules.wpipe import ScheduleWPipe

    __version__: str

# name -> the module that defines it (tests/test_public_names.py checks it against the imports above)
_PUBLIC = {
    "attach": "vpipe._attach",
    "Vpipe": "vpipe._attach",
    "VpipeConfig": "vpipe.config",
    "Plan": "vpipe.plan",
    "Policy": "vpipe.plan",
    "SchedulePipeDream": "vpipe.schedules.pipedream",
    "SchedulePipeDream2BW": "vpipe.schedules.pipedream_2bw",
    "ScheduleWPipe": "vpipe.schedules.wpipe",
    "global_block_keys": "vpipe.checkpoint.block_keys",
    "local_block_keys": "vpipe.checkpoint.block_keys",
}
__all__ = ["Plan", "Policy", "SchedulePipeDream", "SchedulePipeDream2BW", "ScheduleWPipe", "Vpipe",
           "VpipeConfig",
           "__version__", "attach", "global_block_keys", "local_block_keys"]


def _version() -> str:
    """pyproject's ``version``, from the installed package's metadata; a source tree that is not installed
    reads its pyproject.toml (Python 3.11+), else says it does not know."""
    from importlib.metadata import PackageNotFoundError, version  # some milliseconds: only when asked

    try:
        return version("vpipe")
    except PackageNotFoundError:
        pass
    try:
        import tomllib

        project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
        if project["name"] == "vpipe":
            return str(project["version"])
    except (ImportError, OSError, KeyError, ValueError):
        pass
    return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    else:
        module = _PUBLIC.get(name)
        if module is None:
            raise AttributeError(f"module 'vpipe' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
