"""The graph nodes a sampled step's backward-timing hooks sit on, let go of newest first, a step later.

A tensor hook (``Tensor.register_hook``, how the monitor times each block's backward) gives
the tensor's graph node a Python object, and torch frees a chain of such nodes recursively,
a few C stack frames per node: a sampled step hooks one output per block, so a stage of
tens of thousands of blocks would overflow the C stack when its graph is freed (SIGSEGV).
Holding every hooked node stops torch's own release at the newest of them; letting go of
them newest first afterwards frees the graph one block at a time, however many there are.

Torch lets go of a step's graph by the start of the next step (the last stage keeps its
outputs until then), so the nodes hooked in a step are let go of when the next step ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HeldNodes", "first_grad_tensor"]


def first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The tensor of a layer's output whose gradient marks the start
    of its backward (None: no such tensor)."""
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor) and t.requires_grad), None)
    return output if isinstance(output, torch.Tensor) and output.requires_grad else None


class HeldNodes:
    """The hooked nodes of recent steps, by step."""

    def __init__(self) -> None:
        # (iteration, its hooked nodes in forward order), oldest first
        self._steps: list[tuple[int, list[Any]]] = []

    def hook(self, iteration: int, tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> None:
        """Put ``hook`` on ``tensor``'s gradient and keep its node (which the hook gave a Python object)."""
        tensor.register_hook(hook)
        if not self._steps or self._steps[-1][0] != iteration:
            self._steps.append((iteration, []))
        self._steps[-1][1].append(tensor.grad_fn)

    def release(self, before: int | None = None) -> None:
        """Let go of the nodes held for steps before ``before`` (all when None), newest first."""
        keep = [(it, nodes) for it, nodes in self._steps if before is not None and it >= before]
        done = [nodes for it, nodes in self._steps if before is None or it < before]
        self._steps = keep
        while done:
            nodes = done.pop()
            while nodes:
                nodes.pop()  # the newest first: each frees the graph back to the node held before it

    def __len__(self) -> int:
        return sum(len(nodes) for _, nodes in self._steps)
