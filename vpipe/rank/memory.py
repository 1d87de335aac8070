"""Memory accounting of one rank: what each of its stages may spend on saved activations.

A rank's budget (bytes on its device) pays first for what the stages hold whatever their
activation policies: weights and gradients, optimizer state and, under PipeDream, the
extra weight versions stashed for in-flight micro-batches. What is left goes to saved
activations, which the tensor managers keep under it. A rank that runs several stages
(multi-stage schedules) pays all their fixed bytes first and shares what is left between
them as :mod:`vpipe.sharing` says: when the rank's peak with every layer kept fits (its
stages' micro-batches in flight at each moment of the schedule's action list, times what one
keeps, as each tensor manager measured), each stage gets at least its own peak and keeps
everything, as without vpipe. Until every stage has measured what it keeps, or when keeping
everything does not fit, the shares are equal (each stage swaps or recomputes within its
part). The online planner shares a rank's budget the same way.

Optimizer state appears at the first ``step()``: until then it is counted as the optimizer
will make it (Adam-like: two moments, momentum SGD: one), so that step 0 gets no more room
for activations than the steps after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vpipe.sharing import keep_all_shares
from vpipe.tensor_manager import MemoryBudgetError, TensorManager
from vpipe.tensor_manager.budget import expected_state_factor, stage_fixed_bytes

__all__ = ["StageMemory", "tensor_bytes_of", "apply_budgets"]


def tensor_bytes_of(tensors: Any) -> int:
    """Bytes the tensors hold on this rank (an FSDP2 shard: its local part)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


class StageMemory:
    """The activation budget of one stage: its share of what the rank's budget leaves after every local
    stage's fixed bytes."""

    def __init__(self, stage_index: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 budget: int | None, *, weight_versions: int = 1, siblings: list[StageMemory] | None = None,
                 together: Sequence[Sequence[int]] | None = None) -> None:
        self.stage_index = stage_index
        self.module = module
        self.optimizer = optimizer
        self.budget = budget  # the rank's
        self.weight_versions = weight_versions
        self.siblings = siblings if siblings is not None else [self]  # the rank's stages, this one among them
        if self not in self.siblings:
            self.siblings.append(self)
        # micro-batches each stage (a column per stage of the pipeline)
        # holds at each moment of the action lists
        self.together = together
        self._key: tuple[Any, ...] | None = None
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

    def activation_budget(self, layers_epoch: int = 0,
                          needs: Mapping[int, tuple[int, int]] | None = None) -> int | None:
        """The budget left for saved activations; recomputed only when the layers, the optimizer state or the
        needs changed.

        ``layers_epoch`` changes whenever layers move or are edited (the plan epoch); ``needs``: per stage
        index, one micro-batch's kept bytes (0: not measured yet) and its most micro-batches in flight, which
        divide a shared budget.
        """
        if self.budget is None:
            return None
        mates = sorted(s.stage_index for s in self.siblings)
        need = tuple((needs or {}).get(v, (0, 1)) for v in mates) if len(mates) > 1 else ()
        key = (layers_epoch, len(self.optimizer.state) if self.optimizer is not None else 0, need)
        if key != self._key or self._activation is None:
            fixed = sum(stage.fixed_bytes() for stage in self.siblings)
            if fixed >= self.budget:
                what = (f"stage {self.stage_index}" if len(self.siblings) == 1
                        else f"stages {sorted(s.stage_index for s in self.siblings)}")
                raise MemoryBudgetError(f"{what}: parameters, gradients, optimizer state and "
                                        "stashed weight versions "
                                        f"take {fixed} bytes, the memory budget is {self.budget} bytes")
            left = self.budget - fixed
            shares = keep_all_shares(left, [kept for kept, _ in need], [count for _, count in need],
                                     self.together,
                                     mates) if need else None
            share = int(shares[mates.index(self.stage_index)]) if shares else left // len(self.siblings)
            self._key, self._activation = key, share
        return self._activation


def apply_budgets(tensor_managers: Mapping[int, TensorManager], memories: Mapping[int, StageMemory],
                  epoch: int) -> None:
    """Give each stage's tensor manager its activation budget (a rank's stages share theirs by need); a
    manager whose budget holds every layer kept goes back to keeping those it escalated."""
    if all(memories[v].budget is None for v in tensor_managers):
        return  # no budget on this rank: nothing to give or share (every step's boundary asks)
    needs = {v: manager.keep_all_need() for v, manager in tensor_managers.items()} \
        if len(tensor_managers) > 1 else None
    for v, manager in tensor_managers.items():
        if memories[v].budget is not None:
            manager.budget_bytes = memories[v].activation_budget(epoch, needs)
            manager.relax()
