"""Which steps the monitors measure: every ``every``-th, less often while nothing changes.

A sampled step costs more than a plain one (layer timing hooks, memory readings, a stats
record sent down the pipeline, the planner's turn). While the layers and the plan stay as
they are, the stats a sample brings are the ones the last samples brought, so the interval
doubles after each ``backoff_after`` samples, up to ``max_every`` steps. A change (a plan
applied, layers added or removed) restarts the schedule at the base rate, so the planner
sees its effect as soon as before.

Every rank must sample the same iterations (a stats vector joins the records of one
iteration from every stage), so the schedule is a function of the iteration and of the
iterations at which it restarted; vpipe restarts it only at step boundaries where every
rank does the same (a plan takes effect, a layer edit).
"""

from __future__ import annotations

__all__ = ["SampleSchedule"]


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class SampleSchedule:
    """Sampled iterations: ``every - 1``, ``2 * every - 1``, ... after each restart; the interval doubles
    after each ``backoff_after`` samples, up to ``max_every`` (``max_every == every``: a fixed interval)."""

    def __init__(self, every: int = 10, *, max_every: int | None = None, backoff_after: int = 5) -> None:
        self.every = _positive_int("sample_every", every)
        self.max_every = every if max_every is None else _positive_int("max_sample_every", max_every)
        if self.max_every < self.every:
            raise ValueError(f"max_sample_every ({self.max_every}) must be at least "
                             f"sample_every ({self.every})")
        self.backoff_after = _positive_int("backoff_after", backoff_after)
        self.origin = 0  # the iteration the schedule last restarted at

    def restart(self, iteration: int) -> None:
        """Something changed before ``iteration``: sample at the base rate from there."""
        self.origin = iteration

    def interval_at(self, iteration: int) -> int:
        """Steps between the samples around ``iteration``."""
        return self._phase(iteration - self.origin)[1]

    def is_sampled(self, iteration: int) -> bool:
        """Whether the monitors measure ``iteration`` (never the
        restart's own step: it carries one-off costs)."""
        offset = iteration - self.origin
        if offset < 0:
            return False
        start, interval = self._phase(offset)
        return (offset - start + 1) % interval == 0

    def _phase(self, offset: int) -> tuple[int, int]:
        """(offset where the phase holding ``offset`` starts, its interval)."""
        start, interval = 0, self.every
        while interval < self.max_every and offset >= start + interval * self.backoff_after:
            start += interval * self.backoff_after
            interval = min(2 * interval, self.max_every)
        return start, interval

    def __repr__(self) -> str:
        return (f"SampleSchedule(every={self.every}, max_every={self.max_every}, "
                f"backoff_after={self.backoff_after}, origin={self.origin})")
