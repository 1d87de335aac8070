"""One optimizer per model part (torchtitan's container): which part takes the layers that arrive on a stage.

With several stages per rank torchtitan builds one optimizer per stage module and steps
them together (``OptimizersContainer``, a list in other trainers). A layer that moves must
leave its stage's optimizer and join the one of the stage it lands on, in the param group
with the same settings there (:mod:`.groups`). :class:`OptimizerParts` stands for the container wherever vpipe
reads an optimizer (every part's param groups, one after another, and their state) and
hands each stage its own part (:func:`part_of`) wherever a move edits one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vpipe.stage.groups import GroupMismatch, group_settings, matching_group

__all__ = ["OptimizerParts", "optimizer_parts", "part_of", "move_between", "group_refusal"]


class _PartsState(Mapping[torch.Tensor, Any]):
    """Every part's ``state``, read only. (A ``ChainMap`` would not do: a part's state is a defaultdict, and
    looking a parameter up in the wrong part would add an empty entry there.)"""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        self.parts = parts

    def __getitem__(self, param: torch.Tensor) -> Any:
        for part in self.parts:
            if param in part.state:
                return part.state[param]
        raise KeyError("a parameter none of the optimizer's parts has state for")

    def __iter__(self) -> Iterator[torch.Tensor]:
        for part in self.parts:
            yield from part.state

    def __len__(self) -> int:
        return sum(len(part.state) for part in self.parts)


class OptimizerParts(torch.optim.Optimizer):
    """The parts of an optimizer container, each the optimizer of some of this rank's stages.

    It reads as one optimizer (``param_groups`` are the parts' own group dicts, ``state`` a
    view over theirs) and steps every part; it holds no parameters itself, so
    ``Optimizer.__init__`` is never called.
    """

    def __init__(self, parts: Sequence[torch.optim.Optimizer], stage_parts: Mapping[int, int],
                 container: Any = None) -> None:
        self.parts = list(parts)
        self.stage_parts = dict(stage_parts)  # stage -> index of its part
        self.container = container  # what the trainer passed (steps hooks on it fire)
        self.param_groups = [group for part in self.parts for group in part.param_groups]
        self.state = _PartsState(self.parts)  # type: ignore[assignment]  # reads only: moves edit a stage's part
        self.defaults = dict(self.parts[0].defaults)

    def part(self, stage: int) -> torch.optim.Optimizer:
        return self.parts[self.stage_parts[stage]]

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def register_step_post_hook(self, hook: Callable[..., None]) -> Any:
        """A hook after the step of every part: the container's own (torchtitan's steps its parts inside it),
        else the last part's."""
        owner = self.container if isinstance(self.container, torch.optim.Optimizer) else self.parts[-1]
        return owner.register_step_post_hook(hook)

    def __repr__(self) -> str:
        return f"OptimizerParts({', '.join(type(p).__name__ for p in self.parts)})"


def _parts(optimizer: Any) -> list[torch.optim.Optimizer] | None:
    """The optimizers of a container (torchtitan's ``.optimizers``, or a list / tuple), or None for one optimizer."""
    inner = getattr(optimizer, "optimizers", None)
    parts = inner if isinstance(inner, (list, tuple)) else optimizer if isinstance(optimizer, (list, tuple)) else None
    if parts is None:
        return None
    if not parts or not all(isinstance(p, torch.optim.Optimizer) for p in parts):
        raise TypeError(f"vpipe.attach: optimizer= holds {[type(p).__name__ for p in parts]}; a container must "
                        "hold torch optimizers, one per model part")
    return list(parts)


def optimizer_parts(optimizer: Any, stages: Mapping[int, nn.Module]) -> torch.optim.Optimizer | None:
    """``optimizer`` as vpipe uses it: as given for one optimizer, an :class:`OptimizerParts` for a container.

    Each of this rank's stages must have its parameters in exactly one part (torchtitan builds
    one optimizer per model part); a container of one part is that part.
    """
    parts = _parts(optimizer)
    if parts is None:
        return optimizer
    if len(parts) == 1 and not isinstance(optimizer, torch.optim.Optimizer):
        return parts[0]
    held = [{id(p) for group in part.param_groups for p in group["params"]} for part in parts]
    stage_parts = {}
    for v, module in stages.items():
        mine = {id(p) for p in module.parameters()}
        owners = [i for i, ids in enumerate(held) if ids & mine]
        if len(owners) != 1:
            raise ValueError(f"vpipe.attach: stage {v}'s parameters are in {len(owners)} of the optimizer "
                             f"container's {len(parts)} optimizers; build one optimizer per model part "
                             "(stage module), as torchtitan does")
        stage_parts[v] = owners[0]
    return OptimizerParts(parts, stage_parts, optimizer)


def part_of(optimizer: torch.optim.Optimizer | None, stage: int) -> torch.optim.Optimizer | None:
    """The optimizer that holds ``stage``'s parameters."""
    return optimizer.part(stage) if isinstance(optimizer, OptimizerParts) else optimizer


def _joins(source: torch.optim.Optimizer, target: torch.optim.Optimizer,
           params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """(parameter, its group in ``source``, the group with the same settings in ``target``) per parameter."""
    joins = []
    for p in params:
        g = next((g for g, group in enumerate(source.param_groups) if any(q is p for q in group["params"])), None)
        if g is not None:
            settings = group_settings(source.param_groups[g])
            joins.append((p, g, matching_group(settings, target.param_groups, preferred=g,
                                               what=f"a parameter of shape {tuple(p.shape)}")))
    return joins


def group_refusal(source: torch.optim.Optimizer | None, target: torch.optim.Optimizer | None,
                  params: Iterable[torch.Tensor]) -> str | None:
    """Why :func:`move_between` could not place every parameter (None: it can), asked before a move's vote."""
    if source is not target and source is not None and target is not None:
        try:
            _joins(source, target, params)
        except GroupMismatch as e:
            return str(e)
    return None


def move_between(source: torch.optim.Optimizer | None, target: torch.optim.Optimizer | None,
                 params: Iterable[torch.Tensor]) -> None:
    """Move parameters and their state from ``source`` to ``target`` (a layer moving between two stages of this
    rank whose parts differ), each into the param group there with the settings of the one it leaves.

    Every parameter's group is found before anything is edited, so a ``GroupMismatch`` leaves both as they were.
    """
    if source is target or source is None or target is None:
        return
    for p, g, here in _joins(source, target, params):
        group = source.param_groups[g]["params"]
        group[:] = [q for q in group if q is not p]
        target.param_groups[here]["params"].append(p)
        if p in source.state:
            target.state[p] = source.state.pop(p)
