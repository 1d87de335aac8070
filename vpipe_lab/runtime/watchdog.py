"""Liveness of the ranks of a run, so that a dead rank ends the run instead of hanging it.

Each rank bumps a heartbeat counter in the rendezvous store (the c10d TCPStore, hosted by
the launcher or torchrun's agent, so it outlives any rank) and watches everybody else's.
A rank whose counter stops moving, or that records a failure, ends every other rank with
a message naming it. A rank that fails because a peer vanished (a broken connection)
blames that peer, not itself, so every message names the rank that really died.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from vpipe.checks import shorten
from vpipe.control.curve import remove_private_key_files

log = logging.getLogger("vpipe.runtime")  # the run log keeps vpipe.* loggers

EXIT_PEER_FAILED = 17

_HB = "vpipe/hb/{}"
_DONE = "vpipe/done/{}"
_FAIL = "vpipe/fail/{}"
_NFAIL = "vpipe/nfail"


def is_communication_error(exc: BaseException) -> bool:
    """True for errors that a vanished peer causes (broken connection, timed-out recv)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(w in text for w in ("connection closed", "connection reset", "broken pipe", "gloo", "nccl",
                                   "timed out"))


class Watchdog:
    """Heartbeat thread plus failure records; one per rank."""

    def __init__(self, store: Any, rank: int, world_size: int, *, period_s: float = 0.5,
                 timeout_s: float = 10.0) -> None:
        if timeout_s <= period_s:
            raise ValueError(f"heartbeat timeout {timeout_s} s must exceed the period {period_s} s")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._last_seen: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"vpipe-watchdog-{rank}", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def announce(self) -> None:
        """Create this rank's heartbeat key (before the process group forms, so it exists for all)."""
        self.store.add(_HB.format(self.rank), 1)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def finish(self) -> None:
        """This rank ended normally: peers must not take its silence for a death."""
        self.store.set(_DONE.format(self.rank), "1")
        self._stop.set()

    # ---------------------------------------------------------------- detection
    def _loop(self) -> None:
        store = self.store.clone()  # a connection of its own: the main thread uses self.store
        while not self._stop.wait(self.period_s):
            try:
                store.add(_HB.format(self.rank), 1)
                culprit = self.find_culprit(store)
            except Exception as e:  # the store itself is gone: the launcher died
                self._exit(f"lost the rendezvous store ({e}); the launcher or rank 0's host is gone",
                           EXIT_PEER_FAILED)
                return
            if culprit is not None and culprit[0] != self.rank:
                try:  # say who is to blame, so the launcher can name it (and end it, if it hangs)
                    store.set(_FAIL.format(self.rank), json.dumps({"cause": culprit[0],
                                                                   "error": culprit[1][:500]}))
                    store.add(_NFAIL, 1)
                except Exception:  # noqa: BLE001 - the store is going away with the run
                    pass
                self._exit(f"stopping because {culprit[1]}", EXIT_PEER_FAILED)
                return

    def find_culprit(self, store: Any) -> tuple[int, str] | None:
        """The rank that failed first, with a sentence about it, or None if all are well.

        A rank that recorded its own failure is the culprit. Otherwise the culprit is the
        rank silent for longest beyond the timeout, ignoring ranks that finished normally
        and ranks that recorded that they stopped because of somebody else.
        """
        stopped_for_others: set[int] = set()
        if store.add(_NFAIL, 0) > 0:
            for r in range(self.world_size):
                if store.check([_FAIL.format(r)]):
                    record = json.loads(store.get(_FAIL.format(r)))
                    if record.get("cause", r) == r:
                        if record.get("interrupted"):
                            return r, f"rank {r} was interrupted (Ctrl-C)"
                        return r, f"rank {r} failed: {record.get('error', '?')}"
                    stopped_for_others.add(r)
        now = time.monotonic()
        others = [r for r in range(self.world_size) if r != self.rank]
        counters = store.multi_get([_HB.format(r) for r in others])
        silent: list[tuple[float, int]] = []
        for r, raw in zip(others, counters):
            value = int(raw)
            seen = self._last_seen.get(r)
            if seen is None or seen[0] != value:
                self._last_seen[r] = (value, now)
            elif now - seen[1] > self.timeout_s and r not in stopped_for_others:
                silent.append((now - seen[1], r))
        for seconds, r in sorted(silent, reverse=True):
            if not store.check([_DONE.format(r)]):
                return r, f"rank {r} stopped answering (dead or hung): no heartbeat for {seconds:.1f} s"
        return None

    def blame(self, exc: BaseException) -> tuple[int, str]:
        """Decide who caused ``exc`` on this rank; for broken connections wait for the dead peer to show."""
        if is_communication_error(exc):
            deadline = time.monotonic() + self.timeout_s + 3 * self.period_s
            while time.monotonic() < deadline:
                try:
                    culprit = self.find_culprit(self.store)
                except Exception:
                    break
                if culprit is not None and culprit[0] != self.rank:
                    return culprit
                time.sleep(self.period_s)
        return self.rank, f"rank {self.rank} failed: {type(exc).__name__}: {exc}"

    def record_failure(self, exc: BaseException) -> str:
        """Publish this rank's failure (naming the real culprit) and return the message to print."""
        cause, sentence = self.blame(exc)  # keep the heartbeat going meanwhile: silence would blame us
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        try:
            self.store.set(_FAIL.format(self.rank), json.dumps({"cause": cause, "error": error[:500]}))
            self.store.add(_NFAIL, 1)
        except Exception:
            pass
        self._stop.set()
        return sentence if cause == self.rank else f"stopping because {sentence}"

    def record_interrupt(self) -> None:
        """This rank was interrupted (Ctrl-C): the others stop saying so, not that it failed."""
        try:
            self.store.set(_FAIL.format(self.rank), json.dumps({"cause": self.rank, "error": "interrupted",
                                                                 "interrupted": True}))
            self.store.add(_NFAIL, 1)
        except Exception:  # noqa: BLE001 - the store is going away with the run
            pass
        self._stop.set()

    def _exit(self, message: str, code: int) -> None:
        stderr_line(f"vpipe [rank {self.rank}]: {message}")
        log.error("rank %d: %s", self.rank, message)
        remove_private_key_files()  # os._exit skips atexit
        logging.shutdown()
        os._exit(code)


def stderr_line(line: str) -> None:
    """One write per line: ranks share the launcher's stderr, and print() writes the newline separately,
    so two ranks failing together could run their lines into one."""
    sys.stderr.write(shorten(line) + "\n")  # a 100,000-character value echoed in it, cut
    sys.stderr.flush()
