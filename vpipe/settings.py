"""Names and allowed values of ``VPIPE_*`` variables that a room low in the map reads, shared with the check at
start (:mod:`vpipe.rank.environment`) without importing torch there."""

from __future__ import annotations

__all__ = ["PREFETCH_ALLOC_ENV", "PREFETCH_ALLOCS"]

PREFETCH_ALLOC_ENV = "VPIPE_PREFETCH_ALLOC"
PREFETCH_ALLOCS = ("copy", "compute")  # where prefetched copies are allocated: the copy stream's or the compute's
