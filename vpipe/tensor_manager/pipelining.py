"""Attaching a tensor manager to a ``torch.distributed.pipelining`` stage.

The schedules call ``stage.forward_one_chunk(chunk_id, ...)``,
``stage.backward_one_chunk(chunk_id, ..., full_backward=...)`` and, for zero-bubble
schedules, ``stage.backward_weight_one_chunk(chunk_id)``. Wrapping those three as
*instance attributes* gives the manager the micro-batch id of every forward and backward
without touching ``stage.submod`` (schedules check its type) or the schedule. The
shape-inference forward of the first ``step()`` does not go through
``forward_one_chunk``, so it is neither managed nor counted.

Zero-bubble schedules call ``backward_one_chunk(full_backward=False)`` (the manager's
``"input"`` phase) and later ``backward_weight_one_chunk`` (``"weight"``). On the first
stage torch computes nothing in the first call (no input needs a gradient) and runs the
whole backward in the second: the manager sees no input phase there and one ``"full"``
phase, so nothing is brought back early and held across the gap. A stage built with a
``dw_builder`` runs its full backward in the first call: ``"full"``, then ``"weight"``
around the user's weight function. vpipe's PipeDream schedule
calls the same methods (its forward runs the module through ``functional_call`` on
stashed weights, which the manager recognises as weights and leaves alone).

A step whose micro-batches would all be quiet (see ``QuietPath.for_a_step``) does
not need the wrappers at all: ``StageHandle.run_plain`` sets them aside between steps, and
puts them back for the first step that needs them.
"""

from __future__ import annotations

import weakref
from typing import Any

from vpipe import timeline
from vpipe.compat.torch_distributed import PipelineStageBase
from vpipe.tensor_manager.budget import MemoryBudgetError
from vpipe.tensor_manager.manager import LayerBusyError, TensorManager
from vpipe.tensor_manager.pool import HostPoolFullError

__all__ = ["install_on_stage", "StageHandle"]

_WRAPPED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
_MISSING = object()
_OWN_ERRORS = (MemoryBudgetError, HostPoolFullError, LayerBusyError)
# the stages a manager is installed on now: vpipe's record, not a mark on torch's object (weak: a stage
# dropped by its owner leaves the set by itself)
_installed: weakref.WeakSet[PipelineStageBase] = weakref.WeakSet()


class StageHandle:
    """Returned by :func:`install_on_stage`; ``remove()`` puts the stage's methods back,
    ``run_plain(True)`` sets them aside for as long as the manager has nothing to do."""

    def __init__(self, stage: PipelineStageBase, manager: TensorManager, saved: dict[str, Any],
                 wrappers: dict[str, Any]) -> None:
        self.stage = stage
        self.manager = manager
        self._saved = saved
        self._wrappers = wrappers
        self.removed = False
        self.plain = False  # the stage's own methods are in place (the manager is not called)

    def run_plain(self, plain: bool) -> None:
        """Between steps: with ``plain``, the stage's micro-batches
        call its own methods, not vpipe's wrappers.

        A quiet micro-batch only has its count kept; when a whole step is quiet (every layer kept without
        hooks, nothing in flight, see :meth:`.quiet.QuietPath.for_a_step`), even that call is a cost without a
        use (tens of microseconds per micro-batch on a CPU, between tensor work that has evicted the caches).
        Methods someone else put on the stage since vpipe wrapped it are left alone (``plain`` stays False).
        """
        if self.removed or plain == self.plain:
            return
        stage_attrs = self.stage.__dict__
        if plain:
            if any(stage_attrs.get(name) is not wrapper for name, wrapper in self._wrappers.items()):
                return
            self._restore()
        else:
            stage_attrs.update(self._wrappers)
        self.plain = plain

    def remove(self) -> None:
        if self.removed:
            return
        if not self.plain:
            for name, wrapper in self._wrappers.items():
                if self.stage.__dict__.get(name) is not wrapper:
                    raise RuntimeError(f"stage {self.stage.stage_index}: {name} was replaced "
                                       f"after vpipe wrapped it; cannot restore it")
            self._restore()
        _installed.discard(self.stage)
        self.removed = True

    def _restore(self) -> None:
        for name, previous in self._saved.items():
            if previous is _MISSING:
                del self.stage.__dict__[name]
            else:
                self.stage.__dict__[name] = previous


def _custom_weight_pass(stage: PipelineStageBase) -> bool:
    """A ``dw_builder`` stage: its first backward call is a full backward, the second the user's function."""
    return getattr(stage, "dw_builder", None) is not None


def _whole_backward_deferred(stage: PipelineStageBase) -> bool:
    """The first stage of a split backward: torch runs all of it in ``backward_weight_one_chunk``."""
    return stage.is_first and not _custom_weight_pass(stage)


def _stage_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The tensors a ``forward_one_chunk(chunk_id, args, kwargs)`` call hands the stage, flat; ``()`` for a
    stage that receives its inputs from the previous one (torch passes it no args)."""
    chunk_args = args[0] if args else kwargs.get("args")
    chunk_kwargs = args[1] if len(args) > 1 else kwargs.get("kwargs")
    flat = tuple(chunk_args) if isinstance(chunk_args, (tuple, list)) else ((chunk_args,)
                                                                            if chunk_args is not None
                                                                           else ())
    if isinstance(chunk_kwargs, dict):
        flat += tuple(chunk_kwargs.values())
    return flat


def install_on_stage(stage: PipelineStageBase, manager: TensorManager) -> StageHandle:
    """Route the stage's forwards and backwards through ``manager`` (micro-batch id = chunk id)."""
    if not isinstance(stage, PipelineStageBase):
        raise TypeError("install_on_stage needs a torch.distributed.pipelining stage, got "
                        f"{type(stage).__name__}")
    if stage in _installed:
        raise RuntimeError(f"stage {stage.stage_index} already has a vpipe tensor manager installed")
    saved = {name: stage.__dict__.get(name, _MISSING) for name in _WRAPPED}
    forward = stage.forward_one_chunk
    backward = stage.backward_one_chunk
    backward_weight = stage.backward_weight_one_chunk

    custom_weight_pass = _custom_weight_pass(stage)  # (both fixed when the stage is built)
    whole_backward_deferred = _whole_backward_deferred(stage)
    index = stage.stage_index
    quiet = manager.quiet  # (asked first by every forward and backward)

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not timeline.active():
            return managed_forward(fwd_chunk_id, *args, **kwargs)
        timeline.set_track(index)
        with timeline.span("vpipe.forward", timeline.COMPUTE, index, mb=fwd_chunk_id):
            return managed_forward(fwd_chunk_id, *args, **kwargs)

    def managed_forward(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        # the micro-batch's inputs (the first stage's; later stages receive into buffers of fixed shapes)
        inputs = _stage_inputs(args, kwargs)
        if quiet.begin_forward(fwd_chunk_id, inputs):  # nothing to manage: only counted
            try:
                return forward(fwd_chunk_id, *args, **kwargs)
            finally:
                quiet.end_forward(fwd_chunk_id)
        with manager.micro_batch(fwd_chunk_id, inputs):
            try:
                return forward(fwd_chunk_id, *args, **kwargs)
            except RuntimeError as e:
                # torch <= 2.11 wraps a forward's error in a bare RuntimeError("[Stage k] failed to run
                # forward"); the user needs the tensor manager's own error (its type and advice)
                if isinstance(e.__cause__, _OWN_ERRORS) and type(e) is RuntimeError:
                    raise e.__cause__ from None
                raise

    def backward_one_chunk(bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        if not full_backward and whole_backward_deferred:
            return backward(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        phase = "full" if full_backward or custom_weight_pass else "input"
        if not timeline.active():
            return managed_backward(bwd_chunk_id, loss, full_backward, last_backward, phase)
        timeline.set_track(index)
        with timeline.span("vpipe.backward", timeline.COMPUTE, index, mb=bwd_chunk_id, phase=phase):
            return managed_backward(bwd_chunk_id, loss, full_backward, last_backward, phase)

    def managed_backward(bwd_chunk_id: int, loss: Any, full_backward: bool, last_backward: bool,
                         phase: str) -> Any:
        if quiet.begin_backward(bwd_chunk_id, phase):
            try:
                return backward(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                last_backward=last_backward)
            finally:
                quiet.end_backward(bwd_chunk_id)
        with manager.backward(bwd_chunk_id, phase=phase):
            return backward(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        phase = "full" if whole_backward_deferred else "weight"
        timeline.set_track(index)
        with timeline.span("vpipe.backward", timeline.COMPUTE, index, mb=bwd_chunk_id, phase=phase), \
                manager.backward(bwd_chunk_id, phase=phase):
            return backward_weight(bwd_chunk_id, *args, **kwargs)

    wrappers = {
        "forward_one_chunk": forward_one_chunk,
        "backward_one_chunk": backward_one_chunk,
        "backward_weight_one_chunk": backward_weight_one_chunk,
    }
    stage.__dict__.update(wrappers)
    _installed.add(stage)
    return StageHandle(stage, manager, saved, wrappers)
