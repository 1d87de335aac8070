"""How long a move waits, and who is named when a peer stops answering in the middle of one.

A trainer that passes ``init_process_group(timeout=timedelta(seconds=20))`` expects no
collective to hang longer than that, and a round of moves is one: every rank ends it with a
vote. So a round runs on a clock (:class:`RoundClock`) that starts with the round and gives
it the process group's timeout: each handshake message may take the migration patience
(``migration_timeout_s``, at most half the group's timeout, so that a peer that answered late
still finds the others in the vote), a payload what is left of the round, and the vote what
is left too, but never less than :data:`FLOOR_S` (ranks reach a round a little apart). A
peer that stops answering (SIGSTOP, a hang, a crash) then fails the vote by the round's end
on every other rank.

Who stopped: before each vote every rank appends its rank to one key of the run's store
(:class:`VoteMarks`); a vote that fails reads it and names the ranks that never came. That
read waits at most :data:`ASK_S`: a store whose host is the rank that stopped (a trainer's
own ``init_process_group`` without torchrun) never answers, and then nobody is named.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["FLOOR_S", "RoundClock", "VoteMarks", "patience_s"]

log = logging.getLogger("vpipe.migration")

FLOOR_S = 2.0  # the least a vote waits, however late in its round: ranks begin a round a little apart
ASK_S = 2.0  # how long a failed vote asks the store who reached it


def patience_s(migration_timeout_s: float, group_timeout_s: float) -> float:
    """How long one handshake message may take: ``migration_timeout_s``, at most half the group's timeout."""
    return min(migration_timeout_s, group_timeout_s / 2)


class RoundClock:
    """One round of moves on one rank: every wait of the round ends by ``limit_s`` after its start."""

    def __init__(self, limit_s: float, patience: float, *, floor_s: float = FLOOR_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self.patience_s = patience
        self.floor_s = min(floor_s, limit_s)
        self._now = now
        self.deadline = now() + limit_s

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - self._now())

    def wait_s(self, times: float = 1.0) -> float:
        """How long the next handshake message may take (``times`` the patience, within the round)."""
        return min(times * self.patience_s, self.remaining_s())

    def vote_s(self) -> float:
        """How long the round's vote may take: what is left of the round, at least the floor."""
        return max(self.remaining_s(), self.floor_s)


class VoteMarks:
    """Who reached each vote, in the run's store (``store``: a namespace every voting rank shares).

    Every rank votes the same votes in the same order, so the n-th vote is the same on every
    rank. Rank 0 deletes the marks of the vote before last (every rank has passed it)."""

    def __init__(self, store: Any, *, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def arrive(self, vote: int) -> None:
        self.store.append(f"vote/{vote}", f"{self.rank} ")
        if self.rank == 0 and vote > 2:
            self.store.delete_key(f"vote/{vote - 2}")

    def absent(self, vote: int, wait_s: float = ASK_S) -> list[int] | None:
        """The ranks that never reached vote ``vote`` (None: the store did not answer within ``wait_s``)."""
        answer: list[list[int] | None] = []
        asking = threading.Thread(target=lambda: answer.append(self._absent(vote)), daemon=True,
                                  name="vpipe-vote-marks")  # a stopped store host never answers: not waited for
        asking.start()
        asking.join(wait_s)
        return answer[0] if answer else None

    def _absent(self, vote: int) -> list[int] | None:
        key = f"vote/{vote}"
        try:
            came = self.store.get(key).decode().split() if self.store.check([key]) else []
        except Exception as e:  # noqa: BLE001 - a store gone too (its host stopped): nobody can be named
            log.warning("rank %d: the store did not say who reached vote %d: %s", self.rank, vote, e)
            return None
        return sorted(set(range(self.world_size)) - {int(r) for r in came if r.isdigit()})
