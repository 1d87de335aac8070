"""The backward pass running now: which phase unpacks, and whether its node runs again in the weight pass.

Both sides that bring saved tensors back ask this at every unpack: the swapped side
(:mod:`.phases`, for :mod:`.swap_in`) and the recomputed side (:mod:`.recompute_store`).
It knows nothing of either; what waits between the passes of a split backward is
:mod:`.phases`' job.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from vpipe.compat.torch_internals import current_autograd_node, will_engine_execute_node

__all__ = ["CurrentPass"]


class CurrentPass:
    """The backward phases running now (innermost last) and what the unpacks inside them need to know.

    ``serial`` numbers the ``backward()`` contexts (a storage unpacked under two is multi-phase);
    ``unpacked``: the running phase unpacked a swapped or recomputed tensor.
    """

    def __init__(self) -> None:
        self.running: list[tuple[int, str]] = []  # (micro-batch, phase) of the backwards running now
        self.serial = 0
        self.unpacked = False
        self._reading_inputs = 0  # > 0 while a recompute unpacks its inputs (not a use by a backward node)

    def enter(self, mb: int, phase: str) -> None:
        """A backward phase of ``mb`` starts."""
        self.serial += 1
        self.running.append((mb, phase))
        self.unpacked = False

    def leave(self) -> bool:
        """The innermost phase ends; returns whether it unpacked a swapped or recomputed tensor."""
        self.running.pop()
        return self.unpacked

    def unpack_phase(self) -> str:
        """The phase of the backward unpacking now (``"full"``
        outside any ``backward()``); marks it as used."""
        self.unpacked = True
        return self.running[-1][1] if self.running else "full"

    @contextmanager
    def reading_inputs(self) -> Iterator[None]:
        """Around a recompute unpacking its saved inputs: those unpacks are not a backward node's."""
        self._reading_inputs += 1
        try:
            yield
        finally:
            self._reading_inputs -= 1

    def needed_by_weight_pass(self) -> bool:
        """Whether the autograd node unpacking now runs again in the weight pass of a split backward.

        The input pass (``autograd.grad`` towards the stage inputs) runs only nodes on a path
        to an input; the weight pass later starts from the nodes where that part of the graph
        meets the parameters' (torch's ``stage_backward_weight``) and runs those and the
        nodes below them towards the parameters. So a node runs again exactly when one of its
        next functions is a parameter's gradient accumulator or a node this pass does not
        execute (it leads to parameters only). Measured on torch 2.13 for Linear, LayerNorm,
        attention (matmul and SDPA) and weight-normalised matmuls, this matches the unpacks
        of both passes one for one. A node that reaches parameters only through nodes the
        input pass executes too (a weight tied inside the stage) is missed: its tensors are
        fetched or recomputed again, and counted.
        """
        if self._reading_inputs:
            return False  # a recompute reading its inputs, not a backward node
        node = current_autograd_node()
        if node is None:
            return False
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:  # a leaf's gradient accumulator
                if isinstance(variable, nn.Parameter):
                    return True
                continue
            try:
                if not will_engine_execute_node(child):
                    return True
            except RuntimeError:  # not a node of this pass's graph task: keep rather than fetch twice
                return True
        return False
