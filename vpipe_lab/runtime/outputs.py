"""What a run writes besides checkpoints and results, checked before any rank starts.

vpipe's own outputs on the ranks (the timeline of ``VPIPE_TRACE_STEPS`` in ``VPIPE_TRACE_DIR``,
the metrics of ``VPIPE_METRICS`` in ``VPIPE_METRICS_DIR``) are set in the environment the ranks
inherit; a directory there that is a file, or cannot be written, ends the command with one line
and exit code 2, where each rank used to fail at attach (metrics) or lose its trace in silence.
Torch-free: the command line imports it.
"""

from __future__ import annotations

from collections.abc import Mapping

from vpipe.files import check_output_dir
from vpipe.settings import Settings

__all__ = ["check_vpipe_outputs"]



def check_vpipe_outputs(vpipe: bool, environ: Mapping[str, str] | None = None) -> None:
    """FileCheckError (a ValueError: one line) for a trace or metrics directory vpipe will write on the ranks
    that is not a writable directory (or one that can be made). Nothing to check when the run has no vpipe."""
    if not vpipe:
        return
    settings = Settings.read(environ)
    if settings.trace_steps is not None:
        check_output_dir(settings.trace_dir, "VPIPE_TRACE_DIR")
    if settings.metrics:
        check_output_dir(settings.metrics_dir, "VPIPE_METRICS_DIR")
