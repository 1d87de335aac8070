"""Shape inference that vpipe has torch redo, leaving no trace the trainer could see.

torch's schedules learn what a stage sends by running its forward (and backward) once, inside
the first ``step()``, on the step's inputs or on uninitialised tensors. A trainer without vpipe
runs that pass once. After a layer edit, or a move that changes a boundary's shape, vpipe has
every rank run it again (:func:`~vpipe.stage.pipeline.reset_shape_inference`): an extra forward of
the user's model that the same trainer without vpipe never makes. So that pass runs quiet:

- the user's forward and backward hooks are not called (a stateful hook would count a call the
  trainer never made: fuzz seed 10418, a block added beside a hooked one, diverged);
- buffers (BatchNorm statistics, counters) are put back as they were;
- the random state is restored, so the next step's dropout draws what it would have;
- the last stage's loss is not called where its output is one floating tensor: the metadata
  needs only the shapes of the input gradients, which the output's sum gives alike (a loss that
  counts its calls, to tell a step's first micro-batch, would count one more).

FSDP2's hooks and the tensor-parallel styles' still run (the forward needs them), and so do
vpipe's own. The pass's output shapes are torch's to check: a hook of the user's that changes
its module's output shape would make the next step fail in torch's shape check, never train
on wrong shapes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from vpipe.compat.torch_distributed import wrap_inference_loss, wrap_shape_inference
from vpipe.compat.torch_internals import hooks_of
from vpipe.stage.pins import MOVING_HOOKS, users_hook

__all__ = ["install_quiet_inference", "owe_quiet_inference", "quiet_pass"]

_owed: weakref.WeakSet[Any] = weakref.WeakSet()  # stages whose next shape inference vpipe asked for


def owe_quiet_inference(stage: Any) -> None:
    """Mark a PipelineStage whose shape inference vpipe has reset: from now on, each pass runs quiet."""
    _owed.add(stage)


def install_quiet_inference(stage: Any) -> Callable[[], None] | None:
    """Run ``stage``'s shape inference quiet once vpipe has asked for it again; returns an undo, or
    None where this torch infers shapes otherwise
    (:func:`~vpipe.compat.torch_distributed.wrap_shape_inference`)."""

    def around() -> contextlib.AbstractContextManager[Any]:
        return quiet_pass(stage.submod) if stage in _owed else contextlib.nullcontext()

    def loss(loss_fn: Any) -> Any:
        return _output_sum(loss_fn) if stage in _owed and loss_fn is not None else loss_fn

    undo_loss = wrap_inference_loss(stage, loss)
    undo = wrap_shape_inference(stage, around)
    if undo is None or undo_loss is None:
        for made in (undo, undo_loss):
            if made is not None:
                made()
        return None

    def undo_both() -> None:
        undo()  # the wrapper on top first
        undo_loss()

    return undo_both


def _output_sum(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for the user's loss in shape inference: the sum of a floating output, or the loss itself
    for any other output (a tuple: which of its parts the loss reads decides which gradients exist)."""

    def loss(output: Any, target: Any, **kwargs: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.requires_grad:
            return output.sum()
        return loss_fn(output, target, **kwargs)

    return loss


@contextlib.contextmanager
def quiet_pass(module: nn.Module) -> Iterator[None]:
    """A pass over ``module`` without the user's hooks, its buffers and the random state put back after."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    suspended = _suspend_users_hooks(module)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = [torch.cuda.current_device()] if cuda else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for table, before in suspended:
            table.clear()
            table.update(before)  # every hook back, in its order
        for b, value in buffers:
            if not torch.equal(b, value):
                b.data.copy_(value)  # through .data: the pass's backward may still hold the buffer


def _suspend_users_hooks(module: nn.Module) -> list[tuple[dict[Any, Any], dict[Any, Any]]]:
    """Take the user's forward and backward hooks off every module of ``module``; returns each hook table
    changed, with what it held."""
    suspended = []
    for sub in module.modules():
        for kind in MOVING_HOOKS:
            table = hooks_of(sub, kind)
            users = [key for key, fn in table.items() if users_hook(fn, kind)]
            if users and isinstance(table, dict):
                suspended.append((table, dict(table)))
                for key in users:
                    del table[key]
    return suspended
