"""The steps whose timeline this rank records (``trace_steps``), and the schedule's waits inside them.

:mod:`vpipe.timeline` records what producers report; this part opens and closes its window
at the step boundaries the step driver sees, keeps the pipelining stages' wrappers in place
for those steps (a quiet step would otherwise run without them, unseen), and times the
schedule's waits for its sends and receives by wrapping the function torch's schedules wait
with (:func:`~vpipe.compat.torch_distributed.batch_p2p_wait`) for the window's steps only
(schedules that wait elsewhere, such as the action-list runtime, show no waits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vpipe import timeline
from vpipe.compat.torch_distributed import batch_p2p_wait, set_batch_p2p_wait
from vpipe.log import decision

__all__ = ["TraceWindow"]


class TraceWindow:
    """Records steps ``start`` .. ``start + count - 1`` of this rank into ``directory``."""

    def __init__(self, steps: tuple[int, int] | None, directory: str | Path, *, rank: int, stages: list[int]) -> None:
        self.steps = steps
        self.directory = Path(directory)
        self.rank = rank
        self.stages = stages
        self._original_wait: Any = None
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
                with timeline.span("vpipe.p2p_wait", timeline.COMM, timeline.RANK_TRACK):
                    return original(work)

            self._original_wait = original
            set_batch_p2p_wait(waiting)

    def end_step(self, iteration: int) -> None:
        if self.steps is not None and iteration == self.steps[0] + self.steps[1] - 1:
            self.close()

    def close(self) -> None:
        """End the window (its last step ended, or vpipe detaches inside it) and write this rank's file."""
        if self._original_wait is not None:
            set_batch_p2p_wait(self._original_wait)
            self._original_wait = None
        recorder, self._recorder = self._recorder, None
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
            decision("trace", f"rank {self.rank}: timeline of steps {first}..{first + count - 1} written to {path}; "
                     f"merge with `vpipe trace {self.directory}`", rank=self.rank, path=str(path))
