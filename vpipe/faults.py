"""Fault injection for reliability tests: ``VPIPE_FAULTS="name@rank[,name@rank...]"``.

vpipe promises that a rank that dies or a peer that goes silent never hangs a run or loses
a layer. Those paths only run when something breaks, so tests break things on purpose:
each fault below is checked at the one place it acts, on the rank it names. Unset (the
normal case) it costs a lookup at those places only. The variable is read with the others
(:class:`vpipe.settings.Settings`); what it names is a :class:`Faults` value handed to the parts
that act on it.

Faults:
- ``migration_silent``: as the target of a move, never answer ``migrate_prepare``.
- ``migration_die``: as the target of a move, die (SIGKILL-like exit) after the prepare.
- ``migration_stop``: as the target of a move, stop (SIGSTOP) after the prepare: a rank that hangs.
- ``kill@STEP:RANK``: rank RANK sends itself SIGKILL in the middle of step STEP (at its
  stage's second forward of that step, so its neighbours are mid-step too); see
  :meth:`Faults.kill_step` and :meth:`Faults.install_kill` (the reference trainer installs it).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vpipe.faults")

__all__ = ["Faults", "FAULTS", "parse"]

FAULTS = ("migration_silent", "migration_die", "migration_stop")
ENV = "VPIPE_FAULTS"


def parse(text: str) -> dict[str, set[int]]:
    """``"a@1,b@0"`` -> ``{"a": {1}, "b": {0}}``; ``"kill@5:2"`` -> ``{"kill@5": {2}}``;
    ValueError naming a bad entry."""
    faults: dict[str, set[int]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, rank = entry.partition("@")
        if name == "kill":
            step, colon, rank = rank.partition(":")
            if not (colon and step.isdigit() and rank.isdigit()):
                raise ValueError(f"{ENV}: bad entry {entry!r}; expected kill@STEP:RANK")
            faults.setdefault(f"kill@{int(step)}", set()).add(int(rank))
            continue
        if name not in FAULTS or not sep or not rank.isdigit():
            raise ValueError(f"{ENV}: bad entry {entry!r}; expected NAME@RANK with NAME one of "
                             f"{', '.join(FAULTS)} or kill@STEP:RANK")
        faults.setdefault(name, set()).add(int(rank))
    return faults


@dataclass(frozen=True)
class Faults:
    """The faults one run injects (``VPIPE_FAULTS`` parsed, in :class:`vpipe.settings.Settings`): no global
    state, so two attaches in one process each act on their own."""

    entries: tuple[tuple[str, frozenset[int]], ...] = ()  # (fault name, the ranks it acts on), sorted by name

    @classmethod
    def parse(cls, text: str) -> Faults:
        """The faults ``text`` names (:func:`parse`'s grammar); ValueError naming a bad entry."""
        return cls(tuple(sorted((name, frozenset(ranks)) for name, ranks in parse(text).items())))

    def ranks(self, name: str) -> frozenset[int]:
        return next((ranks for fault, ranks in self.entries if fault == name), frozenset())

    def active(self, name: str, rank: int) -> bool:
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}")
        return rank in self.ranks(name)

    def kill_step(self, rank: int) -> int | None:
        """The step in which ``rank`` must kill itself (``kill@STEP:RANK``), or None."""
        steps = [int(name.split("@")[1]) for name, ranks in self.entries if name.startswith("kill@")
                 and rank in ranks]
        return min(steps) if steps else None

    def install_kill(self, module: Any, rank: int, current_step: Any) -> Any:
        """If ``kill@STEP:RANK`` names ``rank``: a forward hook on ``module`` that SIGKILLs this process at
        its second forward of step ``current_step() == STEP``. Returns the hook handle, or None."""
        step = self.kill_step(rank)
        if step is None:
            return None
        seen = {"forwards": 0}

        def hook(_module: Any, _args: Any, _output: Any) -> None:
            if current_step() == step:
                seen["forwards"] += 1
                if seen["forwards"] == 2:
                    os.kill(os.getpid(), signal.SIGKILL)

        return module.register_forward_hook(hook)

    def migration_faults(self, rank: int) -> Callable[[str], bool]:
        """The layer manager's fault hook for ``rank``: at ``prepare_received``, die (``migration_die``), stop
        (``migration_stop``) or report a peer gone silent (``migration_silent``); never anything when
        ``VPIPE_FAULTS`` names none."""

        def hook(point: str) -> bool:
            if point != "prepare_received":
                return False
            if self.active("migration_die", rank):
                log.error("rank %d: fault injected: dying in the middle of a move", rank)
                os._exit(9)
            if self.active("migration_stop", rank):
                log.error("rank %d: fault injected: stopping (SIGSTOP) in the middle of a move", rank)
                os.kill(os.getpid(), signal.SIGSTOP)
            return self.active("migration_silent", rank)

        return hook
