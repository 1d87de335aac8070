"""Fault injection for reliability tests: ``VPIPE_FAULTS="name@rank[,name@rank...]"``.

vpipe promises that a rank that dies or a peer that goes silent never hangs a run or loses
a layer. Those paths only run when something breaks, so tests break things on purpose:
each fault below is checked at the one place it acts, on the rank it names. Unset (the
normal case) it costs a dictionary lookup at those places only.

Faults:
- ``migration_silent``: as the target of a move, never answer ``migrate_prepare``.
- ``migration_die``: as the target of a move, die (SIGKILL-like exit) after the prepare.

A rank that should die mid-step is killed from outside by the tests (a real SIGKILL).
"""

from __future__ import annotations

import functools
import os

__all__ = ["active", "FAULTS", "parse"]

FAULTS = ("migration_silent", "migration_die")
ENV = "VPIPE_FAULTS"


def parse(text: str) -> dict[str, set[int]]:
    """``"a@1,b@0"`` -> ``{"a": {1}, "b": {0}}``; ValueError naming a bad entry."""
    faults: dict[str, set[int]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, rank = entry.partition("@")
        if name not in FAULTS or not sep or not rank.isdigit():
            raise ValueError(f"{ENV}: bad entry {entry!r}; expected NAME@RANK with NAME one of {', '.join(FAULTS)}")
        faults.setdefault(name, set()).add(int(rank))
    return faults


@functools.lru_cache(maxsize=1)
def _faults() -> dict[str, set[int]]:
    return parse(os.environ.get(ENV, ""))


def active(name: str, rank: int) -> bool:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}")
    return rank in _faults().get(name, ())
