"""Memory accounting of one rank: what each of its stages may spend on saved activations.

A rank's budget (bytes on its device) pays first for what the stages hold whatever their
activation policies: weights and gradients, optimizer state and, under PipeDream, the
extra weight versions stashed for in-flight micro-batches. What is left goes to saved
activations, which the tensor managers keep under it. A rank that runs several stages
(multi-stage schedules) gives each an equal share of the budget, the same split the
planner plans with.

Optimizer state appears at the first ``step()``: until then it is counted as the optimizer
will make it (Adam-like: two moments, momentum SGD: one), so that step 0 gets no more room
for activations than the steps after it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vpipe.tensor_manager import MemoryBudgetError
from vpipe.tensor_manager.budget import expected_state_factor, stage_fixed_bytes

__all__ = ["StageMemory", "tensor_bytes_of"]


def tensor_bytes_of(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class StageMemory:
    """The activation budget of one stage: its share of the rank's budget less its fixed bytes."""

    def __init__(self, stage_index: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 budget: int | None, *, weight_versions: int = 1) -> None:
        self.stage_index = stage_index
        self.module = module
        self.optimizer = optimizer
        self.budget = budget
        self.weight_versions = weight_versions
        self._key: tuple[int, int] | None = None
        self._activation: int | None = None

    def fixed_bytes(self) -> int:
        """Bytes this stage holds whatever its activation policies."""
        params = list(self.module.parameters())
        param_bytes = tensor_bytes_of(params)
        state = 0
        if self.optimizer is not None:
            mine = {id(p) for p in params}
            state = sum(tensor_bytes_of(t for t in st.values() if isinstance(t, torch.Tensor))
                        for p, st in self.optimizer.state.items() if id(p) in mine)
            state = state or expected_state_factor(self.optimizer) * param_bytes
        return stage_fixed_bytes(param_bytes, state, self.weight_versions)

    def activation_budget(self, layers_epoch: int = 0) -> int | None:
        """The budget left for saved activations; recomputed only when the layers or the optimizer state changed.

        ``layers_epoch`` changes whenever layers move or are edited (the plan epoch).
        """
        if self.budget is None:
            return None
        key = (layers_epoch, len(self.optimizer.state) if self.optimizer is not None else 0)
        if key != self._key or self._activation is None:
            fixed = self.fixed_bytes()
            if fixed >= self.budget:
                raise MemoryBudgetError(f"stage {self.stage_index}: parameters, gradients, optimizer state and "
                                        f"stashed weight versions take {fixed} bytes, the memory budget is "
                                        f"{self.budget} bytes")
            self._key, self._activation = key, self.budget - fixed
        return self._activation
