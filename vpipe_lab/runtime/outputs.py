"""What a run writes besides checkpoints and results, checked before any rank starts.

vpipe's own outputs on the ranks (the timeline of ``VPIPE_TRACE_STEPS`` in ``VPIPE_TRACE_DIR``,
the metrics of ``VPIPE_METRICS`` in ``VPIPE_METRICS_DIR``) are set in the environment the ranks
inherit; a directory there that is a file, or cannot be written, ends the command with one line
and exit code 2, where each rank used to fail at attach (metrics) or lose its trace in silence.
Torch-free: the command line imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from vpipe.files import check_output_dir

__all__ = ["check_vpipe_outputs"]

# (the variable that turns the output on, the directory's variable, its default): vpipe.rank.config's
_OUTPUTS = (("VPIPE_TRACE_STEPS", "VPIPE_TRACE_DIR", "vpipe-trace"),
            ("VPIPE_METRICS", "VPIPE_METRICS_DIR", "vpipe-metrics"))


def check_vpipe_outputs(vpipe: bool, environ: Mapping[str, str] | None = None) -> None:
    """FileCheckError (a ValueError: one line) for a trace or metrics directory vpipe will write on the ranks
    that is not a writable directory (or one that can be made). Nothing to check when the run has no vpipe."""
    if not vpipe:
        return
    env = os.environ if environ is None else environ
    for switch, variable, default in _OUTPUTS:
        if env.get(switch):
            check_output_dir(env.get(variable) or default, variable)
