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
A vote breaks as soon as one rank dies, while a live peer may still be waiting for the dead
one's payload: absent from the vote, but not the one that stopped. So every rank also beats
(a counter in the store, every :data:`BEAT_S`), and of the absent ranks those whose beat
stood still for :data:`SILENT_S` are named.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BEAT_S", "FLOOR_S", "SILENT_S", "RoundClock", "VoteMarks", "patience_s"]

log = logging.getLogger("vpipe.migration")

FLOOR_S = 2.0  # the least a vote waits, however late in its round: ranks begin a round a little apart
ASK_S = 2.0  # how long a failed vote asks the store who reached it
BEAT_S = 1.0  # how often a rank's beat counter advances in the store
SILENT_S = 3.0  # a beat that stood still this long: its rank stopped (dead or hung)


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
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def start_beat(self, every_s: float = BEAT_S) -> None:
        """Advance this rank's beat counter every ``every_s`` until :meth:`close` (a thread: a stopped or
        hung process stops beating, one waiting in a collective does not)."""
        def beat() -> None:
            while not self._stop.is_set():
                try:
                    self.store.add(f"beat/{self.rank}", 1)
                except Exception:  # noqa: BLE001 - the store's host is gone: nothing left to tell
                    return
                self._stop.wait(every_s)

        if self._beating is None:
            self._beating = threading.Thread(target=beat, daemon=True, name="vpipe-vote-beat")
            self._beating.start()

    def close(self) -> None:
        self._stop.set()

    def arrive(self, vote: int) -> None:
        """Mark this rank at vote ``vote`` (waits at most :data:`ASK_S`: a store whose host stopped holds the
        call, and the vote then fails on its own)."""
        def mark() -> bool:
            self.store.append(f"vote/{vote}", f"{self.rank} ")
            if self.rank == 0 and vote > 2:
                self.store.delete_key(f"vote/{vote - 2}")
            return True

        _ask(mark, ASK_S, f"rank {self.rank}: could not mark vote {vote} in the store")

    def absent(self, vote: int, wait_s: float = ASK_S) -> list[int] | None:
        """The ranks that never reached vote ``vote`` (None: the store did not answer within ``wait_s``)."""
        key = f"vote/{vote}"

        def came() -> list[int]:
            marks = self.store.get(key).decode().split() if self.store.check([key]) else []
            return sorted(set(range(self.world_size)) - {int(r) for r in marks if r.isdigit()})

        return _ask(came, wait_s, f"rank {self.rank}: the store did not say who reached vote {vote}")

    def silent(self, ranks: list[int], watch_s: float = SILENT_S) -> list[int] | None:
        """Of ``ranks``, those whose beat did not advance within ``watch_s`` (None: the store did not say)."""
        # add(key, 0) reads a counter (and makes one missing: a rank never beat)
        def beats() -> dict[int, int]:
            return {r: int(self.store.add(f"beat/{r}", 0)) for r in ranks}

        what = f"rank {self.rank}: the store did not say whose beat advanced"
        first = _ask(beats, ASK_S, what)
        if first is None:
            return None
        time.sleep(watch_s)
        then = _ask(beats, ASK_S, what)
        return None if then is None else [r for r in ranks if then[r] == first[r]]


def _ask(call: Callable[[], Any], wait_s: float, failed: str) -> Any:
    """``call()``'s answer, or None when it raised or took longer than ``wait_s`` (a thread: a stopped store
    host never answers, and its call is left behind rather than waited for)."""
    answer: list[Any] = []

    def run() -> None:
        try:
            answer.append(call())
        except Exception as e:  # noqa: BLE001 - a store gone too (its host stopped): nothing can be said
            log.warning("%s: %s", failed, e)

    asking = threading.Thread(target=run, daemon=True, name="vpipe-store-ask")
    asking.start()
    asking.join(wait_s)
    return answer[0] if answer else None
