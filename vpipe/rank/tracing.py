"""The steps whose timeline this rank records (``trace_steps``), and the schedule's waits inside them.

:mod:`vpipe.timeline` records what producers report; this part opens and closes its window
at the step boundaries the step driver sees, keeps the pipelining stages' wrappers in place
for those steps (a quiet step would otherwise run without them, unseen), and times the
schedule's waits for its sends and receives by wrapping the function torch's schedules wait
with (:func:`~vpipe.compat.torch_distributed.batch_p2p_wait`) for the window's steps only
(schedules that wait elsewhere, such as the action-list runtime, show no waits). The directory
is checked at attach: a file there, one that cannot be written, or a link another user could have
planted on the way is a ValueError naming ``trace_dir`` then, not a timeline lost at the window's end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vpipe import timeline
from vpipe.compat.torch_distributed import batch_p2p_wait, set_batch_p2p_wait
from vpipe.log import decision
from vpipe.output_paths import check_output_dir

__all__ = ["TraceWindow"]


class TraceWindow:
    """Records steps ``start`` .. ``start + count - 1`` of this rank into ``directory``."""

    def __init__(self, steps: tuple[int, int] | None, directory: str | Path, *, rank: int,
                 stages: list[int]) -> None:
        # at attach, as metrics_dir is: a file there, or a link planted on the way, is refused
        if steps is not None:
            check_output_dir(directory, "trace_dir")
        self.steps = steps
        self.directory = Path(directory)
        self.rank = rank
        self.stages = stages
        self._original_wait: Any = None
        self._waiting: Any = None  # the wrapper this window put on torch's p2p wait
        self._recorder: timeline.Recorder | None = None  # this window's, while it records
        self.written: Path | None = None

    @property
    def recording(self) -> bool:
        return self._recorder is not None

    def begin_step(self, iteration: int) -> None:
        if self.steps is None or iteration != self.steps[0] or self._recorder is not None:
            return
        self._recorder = timeline.start(self.rank, self.directory, self.stages)
        original = batch_p2p_wait()
        if original is not None:
            def waiting(work: Any) -> Any:
                if not self.recording:  # closed under another window's wrapper: pass through
                    return original(work)
                with timeline.span("vpipe.p2p_wait", timeline.COMM, timeline.RANK_TRACK):
                    return original(work)

            waiting.__wrapped__ = original  # type: ignore[attr-defined]
            waiting.vpipe_window = self  # type: ignore[attr-defined]
            self._original_wait, self._waiting = original, waiting
            set_batch_p2p_wait(waiting)

    def end_step(self, iteration: int) -> None:
        if self.steps is not None and iteration == self.steps[0] + self.steps[1] - 1:
            self.close()

    def _restore_wait(self) -> None:
        """Take this window's wrapper off torch's p2p wait, with any closed windows' wrappers under it. Two
        attaches' windows may close in either order: one that is not on top stays as a pass-through until the
        one above it closes and unwinds it."""
        if batch_p2p_wait() is self._waiting:
            below = self._original_wait
            while getattr(below, "vpipe_window", None) is not None and not below.vpipe_window.recording:
                below = below.__wrapped__
            set_batch_p2p_wait(below)
        self._original_wait = self._waiting = None

    def close(self) -> None:
        """End the window (its last step ended, or vpipe detaches inside it) and write this rank's file."""
        recorder, self._recorder = self._recorder, None
        if self._original_wait is not None:
            self._restore_wait()
        if recorder is None:
            return
        try:
            path = timeline.stop(recorder)
        except OSError as e:  # the trace is for the user; training goes on without it
            decision("trace", f"rank {self.rank}: the timeline could not be written to {self.directory}: {e}",
                     rank=self.rank, error=str(e))
            return
        if path is not None and self.steps is not None:
            self.written = path
            first, count = self.steps
            decision("trace",
                     f"rank {self.rank}: timeline of steps {first}..{first + count - 1} written to {path}; "
                     f"merge with `vpipe trace {self.directory}`", rank=self.rank, path=str(path))
