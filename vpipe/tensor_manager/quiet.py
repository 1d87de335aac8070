"""The quiet path: micro-batches that need nothing of the tensor manager but their count.

With nothing to measure, decide or enforce (every layer kept and measured, metering off,
and no budget or one that a step's micro-batches fit) the layers' hooks come off
(:meth:`QuietPath.update`): a kept layer then costs what it costs without vpipe. Once
nothing saved through the hooks is alive any more, a micro-batch's forward or full backward
has nothing to release, copy, fetch or decide, only its count to keep: its layers' measured
bytes, counted when its forward ends, so a budget still sees it. Under a budget its inputs
must have the shapes of the last measured micro-batch, or it could save more than was
measured.

The begin/end pairs below are the whole of vpipe's work around a quiet micro-batch; they run
between a step's tensor work with cold caches, so they do as little as they can in as few
calls, and the stage wrappers (:mod:`.pipelining`) call them directly. A step whose
micro-batches would all be quiet may skip even them (:meth:`QuietPath.for_a_step`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vpipe.tensor_manager.governor import BudgetGovernor
from vpipe.tensor_manager.in_flight import InFlight
from vpipe.tensor_manager.interception import Interceptor
from vpipe.tensor_manager.layers import ManagedLayer, input_shapes
from vpipe.tensor_manager.phases import BackwardPhases

__all__ = ["QuietPath"]


class QuietPath:
    """Whether the layers run without hooks, and the micro-batches that then are only counted.

    ``input_shapes``: the tensor input shapes of the last micro-batch run with hooks (None: not
    known, the caller did not say; :meth:`measured_with`); under a budget a quiet micro-batch
    must have these.
    """

    def __init__(self, *, layers: Mapping[int, ManagedLayer], calls: Interceptor, budget: BudgetGovernor,
                 phases: BackwardPhases, in_flight: InFlight) -> None:
        self._layers = layers  # the manager's, read only
        self._calls = calls
        self._budget = budget
        self._phases = phases
        self._in_flight = in_flight
        self.hookless = False
        self.input_shapes: tuple[Any, ...] | None = None
        self._counts: list[tuple[int, int]] | None = None  # (layer, bytes) a micro-batch without hooks counts
        self._ready = False  # hookless, and nothing saved through the hooks alive (see _became_quiet)
        self._closed = False

    # ------------------------------------------------------------------ the hooks
    def update(self, metering: bool, all_keep: bool) -> None:
        """Take the layers' hooks off, or put them back, for the manager's settings now."""
        budget, flight = self._budget, self._in_flight
        self._set(not metering and all_keep and bool(self._layers)
                  and all(layer.kept_bytes is not None for layer in self._layers.values())
                  and (budget.budget_bytes is None or (
                      self.input_shapes is not None and budget.holds_unwatched(flight.peak()))))

    def _set(self, hookless: bool) -> None:
        self._counts = None  # (what they are counted with is worked out again at the next such micro-batch)
        self._ready = False
        if hookless != self.hookless:
            self.hookless = hookless
            for layer in self._layers.values():
                layer.unhook() if hookless else layer.hook()

    def measured_with(self, inputs: tuple[Any, ...] | None) -> None:
        """A micro-batch with these stage inputs (None: not known)
        runs with hooks: its shapes are measured."""
        self.input_shapes = None if inputs is None else input_shapes(inputs)

    def forget_counts(self) -> None:
        """The layers a micro-batch runs changed (one left the forward path): count the next one anew."""
        self._counts = None

    def close(self) -> None:
        self._closed = True
        self._ready = False

    def _became_quiet(self) -> bool:
        """Whether the layers run without hooks and nothing saved through them is
        alive any more. It stays so until the hooks change (nothing can be saved
        through hooks that are not there), so it is remembered."""
        self._ready = self.hookless and not self._closed and self._calls.holds_nothing
        return self._ready

    def count(self, mb: int) -> None:
        """Count ``mb``'s forward, run without hooks, with its layers' measured bytes."""
        counts = self._counts
        if counts is None:
            counts = self._counts = [(lid, layer.kept_bytes or 0) for lid, layer in self._layers.items()
                                     if not layer.retired]
        self._calls.count_unhooked(mb, counts)

    # ------------------------------------------------------------------ one micro-batch
    def begin_forward(self, mb: int, inputs: tuple[Any, ...] | None = None) -> bool:
        """Start ``mb``'s forward if it is quiet (then :meth:`end_forward` must follow); False: it is not, use
        :meth:`TensorManager.micro_batch <vpipe.tensor_manager.manager.TensorManager.micro_batch>` (see there
        for ``inputs``)."""
        calls = self._calls
        if (not self._ready and not self._became_quiet()) or calls.forwarding or not torch.is_grad_enabled():
            return False
        if self._budget.budget_bytes is not None and (inputs is None
                                                      or input_shapes(inputs) != self.input_shapes):
            # new shapes (or unknown ones) under a budget: the hooks
            # come back and this micro-batch is measured
            self.input_shapes = None
            self._set(False)
            return False
        flight = self._in_flight
        flight.forward_starts(mb)
        calls.uncount(mb)  # a micro-batch of a step that failed before its backward
        flight.add(mb)
        return True

    def end_forward(self, mb: int) -> None:
        self.count(mb)

    def begin_backward(self, mb: int, phase: str) -> bool:
        """Start ``mb``'s backward phase if it is a quiet full backward (then :meth:`end_backward` must
        follow); False: use :meth:`TensorManager.backward
        <vpipe.tensor_manager.manager.TensorManager.backward>`."""
        if phase != "full" or (not self._ready and not self._became_quiet()) or self._phases.lagging:
            return False
        self._in_flight.backward_starts(mb)
        return True

    def end_backward(self, mb: int) -> None:
        self._in_flight.ended(mb)
        self._calls.uncount(mb)

    # ------------------------------------------------------------------ a whole step
    def for_a_step(self, same_inputs: bool, stream: bool = False) -> bool:
        """Between steps: whether a whole step's micro-batches would all be quiet, so that the
        stage may run them without calling the manager at all (:meth:`StageHandle.run_plain`).
        Besides the layers running without hooks with nothing saved through them alive, no
        micro-batch may be inside a forward or between its backward passes, and none in flight (a
        flush schedule between steps has none) or, with ``stream`` (a schedule whose micro-batches
        stay in flight across steps), none in flight that is more than counted. Under a budget the
        step's inputs must have the shapes of the last step's (``same_inputs``): each micro-batch
        of that step was quiet with its shapes checked, or was measured."""
        calls = self._calls
        if not (self._ready or self._became_quiet()) or calls.forwarding or self._phases.lagging:
            return False
        if not same_inputs and self._budget.budget_bytes is not None:
            return False
        opened = self._in_flight.open
        return opened <= calls.counted.keys() if stream else not opened and not calls.counted

    def forget_in_flight(self) -> None:
        """A stream's stage runs without the manager from this step: the backwards of its micro-batches in
        flight will not be seen, so their counts go now (their forwards were quiet: counted, nothing else)."""
        self._calls.uncount_all()
        self._in_flight.forget()

    def count_in_flight(self, mbs: Iterable[int]) -> None:
        """A stream's stage calls the manager again from this step: count the micro-batches its forwards
        left in flight while it did not, as their quiet forwards would have."""
        for mb in mbs:
            self._calls.uncount(mb)
            self._in_flight.add(mb)
            self.count(mb)
