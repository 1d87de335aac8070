"""The layers' times of a sampled step, from marks their hooks take: forward calls and backward passes.

:class:`~vpipe.monitors.stage.StageMonitor` decides when its hooks exist (a sampled iteration) and what a
record holds; this module is what the hooks do while they exist, and the per-layer times the marks add up
to. A forward pre-hook and a forward hook per layer mark each call's start and end. The forward hook also
puts a gradient hook on the layer's output; it fires when the gradient of that output is ready, i.e. when
the layer's backward starts. In one backward pass the layers' starts come one after another (a stage is a
chain), so a layer's backward lasts until the next start, and the stage's first layer until the pass ends
(an autograd engine callback); the hooked nodes are held a step longer (:mod:`.held_nodes`: the graph is
then freed one block at a time). A forward inside a backward (recomputation) is part of the layer's
backward, as in the cost model (b + R*f), and a forward without grad (evaluation) or while the monitor is
suspended is not timed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from vpipe.compat.torch_internals import queue_engine_callback
from vpipe.monitors.clock import Clock
from vpipe.monitors.held_nodes import HeldNodes, first_grad_tensor
from vpipe.tensor_manager.accounting import tensor_bytes

__all__ = ["LayerTimer", "OUTSIDE"]

# the stage module as a whole, timed like a layer; minus its blocks it is what lies outside them
OUTSIDE = -1


class LayerTimer:
    """The marks of one stage's hooks in the open sampled iteration, and the layers' times they give.

    ``armed``: the hooks exist (the monitor sets it with them); ``out_bytes``: each layer's output bytes at
    its last timed forward.
    """

    def __init__(self, clock: Clock, held: HeldNodes) -> None:
        self._clock = clock
        self._held = held
        self.armed = False
        self._suspended = 0
        self._iteration = 0
        self._fwd_open: dict[int, Any] = {}
        self._last_block_out: torch.Tensor | None = None
        self.out_bytes: dict[int, int] = {}
        self._fwd: list[tuple[int, Any, Any]] = []
        self._bwd_pass: list[tuple[int, Any]] | None = None
        self._bwd_passes: list[tuple[list[tuple[int, Any]], Any]] = []

    def start(self, iteration: int) -> None:
        """A sampled iteration begins: the marks of the last one are dropped."""
        self._iteration = iteration
        self._fwd_open.clear()
        self._fwd.clear()
        self._bwd_pass = None
        self._bwd_passes.clear()

    def forget(self, layer_id: int) -> None:
        """The layer left the stage: a forward of it still open is not timed."""
        self._fwd_open.pop(layer_id, None)

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Forwards and backwards inside this block are not timed."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # ---------------------------------------------------------------- the hooks
    def _counts(self, args: tuple[Any, ...]) -> bool:
        if self._suspended or self._bwd_pass is not None or not torch.is_grad_enabled():
            return False
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return first is None or not first.is_meta

    def forward_start(self, layer_id: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._counts(args):
            self._fwd_open[layer_id] = self._clock.mark()

    def forward_end(self, layer_id: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        start = self._fwd_open.pop(layer_id, None)
        if start is None:
            return
        self._fwd.append((layer_id, start, self._clock.mark()))
        out = first_grad_tensor(output)
        if layer_id == OUTSIDE:
            last, self._last_block_out = self._last_block_out, None
            if out is None or out is last:
                return  # the stage ends with a block: nothing after it to time in the backward
        else:
            self.out_bytes[layer_id] = tensor_bytes(output)
            self._last_block_out = out
        if out is not None:
            self._held.hook(self._iteration, out, partial(self._backward_start, layer_id))

    def _backward_start(self, layer_id: int, grad: torch.Tensor) -> None:
        if not self.armed or self._suspended:
            return
        if self._bwd_pass is None:
            self._bwd_pass = []
            queue_engine_callback(self._backward_done)
        self._bwd_pass.append((layer_id, self._clock.mark()))

    def _backward_done(self) -> None:
        if self._bwd_pass is not None:
            self._bwd_passes.append((self._bwd_pass, self._clock.mark()))
            self._bwd_pass = None

    # ---------------------------------------------------------------- the times
    def layer_times(self) -> tuple[dict[int, float], Counter, dict[int, float], Counter]:
        """Per layer: forward seconds, forward calls, backward seconds, backward calls."""
        clock = self._clock
        ends = [end for _, _, end in self._fwd[-1:]] + [end for _, end in self._bwd_passes]
        for end in ends:
            clock.settle(end)
        fwd_s: dict[int, float] = defaultdict(float)
        bwd_s: dict[int, float] = defaultdict(float)
        fwd_calls: Counter = Counter()
        bwd_calls: Counter = Counter()
        for layer_id, start, end in self._fwd:
            fwd_s[layer_id] += clock.seconds(start, end)
            fwd_calls[layer_id] += 1
        for events, end in self._bwd_passes:
            follow = [mark for _, mark in events[1:]] + [end]
            for (layer_id, start), stop in zip(events, follow):
                bwd_s[layer_id] += clock.seconds(start, stop)
                bwd_calls[layer_id] += 1
        return fwd_s, fwd_calls, bwd_s, bwd_calls
