"""Recipes users wrap around a trainer's blocks and steps: compiled blocks, and torch's AMP GradScaler.

``compiled``: each block compiled as torchtitan does it (``torch.compile(block)`` in its container,
or ``block.compile()`` in place). ``scaler=skips``: a ``torch.amp.GradScaler`` on CPU scales each
micro-batch's loss inside the schedule's loss function, and at the end of a window the trainer
unscales before clipping and lets the scaler step (or skip) each optimizer, then updates it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# aot_eager, not inductor: inductor's C++ codegen costs tens of seconds a graph on two shared cores,
# in every forked rank, for every block kind, autocast and parametrization drawn (hundreds of draws);
# aot_eager still runs what vpipe meets under inductor (the OptimizedModule wrapper and its
# ``_orig_mod`` names, dynamo's guards on the module, AOTAutograd's joint graph and its saved
# tensors) and torch's own tests cover inductor's kernels
BACKEND = "aot_eager"
INIT_SCALE = 2.0**8  # powers of two: scaling and unscaling are exact in fp32
GROWTH_INTERVAL = 2  # the scale doubles after every 2 steps without overflow: it changes during the run


def compile_block(compiled: str, block: nn.Module) -> nn.Module:
    """``block`` compiled as the draw says: a new OptimizedModule (``wrap``), or the block itself with
    ``compile()`` applied (``in_place``)."""
    if compiled == "wrap":
        return torch.compile(block, backend=BACKEND)
    if compiled == "in_place":
        block.compile(backend=BACKEND)
    return block


def compile_blocks(compiled: str, blocks: nn.Module, schedule: str) -> None:
    """Every block of a stage's container compiled (torchtitan's
    ``apply_compile``: each block, in place of itself)."""
    if compiled == "none":
        return
    # torch's ZBV runs a block's input backward with retain_graph=True, which a compiled backward with donated
    # buffers refuses (the trainer without vpipe too): such users turn donation off, as torch's error says
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = schedule != "zbv"
    for key, block in list(blocks.named_children()):
        new = compile_block(compiled, block)
        if new is not block:  # under its own name, in its place (keys are ids or positions)
            setattr(blocks, key, new)


def forget_compiled() -> None:
    """Each draw compiles from nothing: what an earlier draw
    compiled (guards, recompile counts) changes nothing."""
    torch._dynamo.reset()


class ScaledLoss:
    """The schedule's loss function under GradScaler: the drawn loss, scaled. A step marked to
    overflow has a bad first micro-batch: its loss (the one whose target starts the step's target
    tensor) is infinite, so every gradient of the step is non-finite on every stage. The bad
    micro-batch is told by its data, not by counting calls: torch's shape inference calls the loss
    once more at the first step (and vpipe makes it redo that after ``vp.add_layers``, one call more
    than without vpipe: seed 74 of commit ac34aaa, where a call count chose it)."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss
        self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        # a pipeline rank without the loss never calls scale(), which makes the scale tensor: make
        # it on every rank (unscale_ divides by it there too)
        self.scaler.scale(torch.zeros(()))
        # the data pointer of the overflowing step's target (its first micro-batch's)
        self.bad: int | None = None

    def overflow(self, target: torch.Tensor | None) -> None:
        """The next step overflows where ``target`` is its target (None: it does not)."""
        self.bad = None if target is None else target.data_ptr()

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.scaler.scale(self.loss(out, target))
        if self.bad is not None and target.data_ptr() == self.bad and target.device.type != "meta":
            loss = loss * float("inf")
        return loss


def unscale(scaled: ScaledLoss | None, optimizers: list[torch.optim.Optimizer]) -> None:
    """The AMP recipe's ``scaler.unscale_(optimizer)`` for each optimizer, before clipping."""
    if scaled is not None:
        for o in optimizers:
            scaled.scaler.unscale_(o)


def step_all(scaled: ScaledLoss | None, optimizers: list[torch.optim.Optimizer]) -> None:
    """``scaler.step(o)`` for each optimizer (skipped where its gradients were not finite) and one
    ``scaler.update()``; plain ``o.step()`` without a scaler."""
    if scaled is None:
        for o in optimizers:
            o.step()
        return
    for o in optimizers:
        scaled.scaler.step(o)
    scaled.scaler.update()


def all_reduce_grads(c: Any) -> None:
    """Plain data-parallel replicas (no DDP, no FSDP2): the trainer averages each gradient over its dp
    group, in the stage modules' parameter order (the replicas hold the same blocks in the same order)."""
    import torch.distributed as dist

    for module in c.modules:
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=c.dp_group)
                p.grad /= dist.get_world_size(c.dp_group)
