"""An attach's undos, registered as each thing is made and run newest first: at detach, or at once when the
attach fails half-way (:func:`vpipe.rank.build.build_rank`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

log = logging.getLogger("vpipe.attach")

__all__ = ["Cleanups"]


class Cleanups:
    """An attach's undos, in the order their things were made; :meth:`run` runs each once, newest first.

    Every undo runs whatever another raised (an undo that fails must not leave the
    rest installed); what they raised is returned, not raised, so a failed attach
    propagates its own error and a detach reports the first.
    """

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._errors: list[Exception] = []
        self.built = False  # every step succeeded: the undos are a detach's
        # how long the control session's close waits for its peers' last stats
        self.wait_s: float | None = None

    def add(self, undo: Callable[[], object]) -> None:
        """Register the undo of what was just made (what it returns is ignored)."""
        self._stack.callback(self._guarded, undo)

    def _guarded(self, undo: Callable[[], object]) -> None:
        try:
            undo()
        except Exception as e:  # noqa: BLE001 - undo as much as possible, then report
            self._errors.append(e)

    def run(self) -> list[Exception]:
        """Run every undo registered (newest first, once); the errors they raised."""
        self._stack.close()
        errors, self._errors = self._errors, []
        return errors

    @contextlib.contextmanager
    def until_built(self) -> Iterator[None]:
        """Inside: a failure runs every undo registered so far and
        propagates unchanged; after: the undos are kept."""
        try:
            yield
        except BaseException:
            self.wait_s = 0.0  # nothing was trained: no peer's stats to wait for
            for error in self.run():
                log.warning("vpipe.attach failed; undoing it failed too: %s", error)
            raise
        self.built = True
