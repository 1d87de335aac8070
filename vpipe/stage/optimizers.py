"""Several optimizers on a rank: one per model part (torchtitan's container), or several for one stage.

With several stages per rank torchtitan builds one optimizer per stage module and steps
them together (``OptimizersContainer``, a list in other trainers). A layer that moves must
leave its stage's optimizer and join the one of the stage it lands on, in the param group
with the same settings there (:mod:`.groups`). :class:`OptimizerParts` stands for the container wherever vpipe
reads an optimizer (every part's param groups, one after another, and their state) and
hands each stage its own part (:func:`part_of`) wherever a move edits one.

One stage may also be trained by several optimizers (the Muon recipe: Muon for the blocks'
2-D weights, AdamW for norms, biases and embeddings). :class:`StageOptimizers` reads them as
one: their param groups one after another, a state that routes each parameter to the
optimizer whose groups hold it. A moved parameter is packed with its group's settings, and
on its new stage joins the group with the same settings, so the optimizer of the same kind,
state and all (Muon's and AdamW's groups never share settings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from vpipe.stage.groups import GroupMismatch, group_settings, matching_group

__all__ = ["OptimizerParts", "StageOptimizers", "optimizer_parts", "raw_optimizers", "part_of",
           "move_between",
           "group_refusal", "wrapper_refusal", "group_kinds"]


class _RoutedState(MutableMapping[torch.Tensor, Any]):
    """The state of several optimizers of one stage: a parameter's entry is the one in the
    optimizer whose param groups hold it. An entry another optimizer keeps for it is not
    its state (Adagrad fills its state at construction: a trainer that then hands the
    matrices to Muon leaves Adagrad entries for them behind)."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        self.parts = parts

    def _holder(self, param: torch.Tensor) -> torch.optim.Optimizer | None:
        for part in self.parts:
            if any(q is param for group in part.param_groups for q in group["params"]):
                return part
        return None

    def __getitem__(self, param: torch.Tensor) -> Any:
        holder = self._holder(param)
        if holder is None or param not in holder.state:
            raise KeyError("a parameter the stage's optimizers hold no state for")
        return holder.state[param]

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        holder = self._holder(param)
        if holder is None:
            raise KeyError("a parameter none of the stage's optimizers holds")
        holder.state[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        holder = self._holder(param)
        if holder is None or param not in holder.state:
            raise KeyError("a parameter the stage's optimizers hold no state for")
        del holder.state[param]

    def _held(self) -> Iterator[torch.Tensor]:
        for part in self.parts:
            mine = {id(q) for group in part.param_groups for q in group["params"]}
            yield from (p for p in part.state if id(p) in mine)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self._held()

    def __len__(self) -> int:
        return sum(1 for _ in self._held())


class StageOptimizers(torch.optim.Optimizer):
    """Several optimizers of one stage (Muon and AdamW), read and
    stepped as one; holds no parameters itself."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer], container: Any = None) -> None:
        self.parts = list(parts)
        self.container = container
        self.param_groups = [group for part in self.parts for group in part.param_groups]
        self.state = _RoutedState(self.parts)  # type: ignore[assignment]
        self.defaults = dict(self.parts[0].defaults)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def register_step_post_hook(self, hook: Callable[..., None]) -> Any:
        """After the last optimizer's step (the trainer steps them in its order)."""
        return self.parts[-1].register_step_post_hook(hook)

    def __repr__(self) -> str:
        return f"StageOptimizers({', '.join(type(p).__name__ for p in self.parts)})"


class OptimizerParts(StageOptimizers):
    """The parts of an optimizer container, each the optimizer of some of this
    rank's stages (or the several optimizers of one, as a :class:`StageOptimizers`):
    read and stepped as one, each stage handed its own part."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer], stage_parts: Mapping[int, int],
                 container: Any = None) -> None:
        super().__init__(parts, container)
        self.stage_parts = dict(stage_parts)  # stage -> index of its part

    def part(self, stage: int) -> torch.optim.Optimizer:
        return self.parts[self.stage_parts[stage]]

    def register_step_post_hook(self, hook: Callable[..., None]) -> Any:
        """A hook after the step of every part: the container's own (torchtitan's steps its parts inside it),
        else the last part's."""
        owner = self.container if isinstance(self.container, torch.optim.Optimizer) else self.parts[-1]
        return owner.register_step_post_hook(hook)


def _parts(optimizer: Any) -> list[torch.optim.Optimizer] | None:
    """The optimizers of a container (torchtitan's ``.optimizers``,
    or a list / tuple), or None for one optimizer."""
    inner = getattr(optimizer, "optimizers", None)
    parts = inner if isinstance(inner, (list, tuple)) else optimizer if isinstance(optimizer,
                                                                                   (list, tuple)) else None
    if parts is None:
        return None
    if not parts or not all(isinstance(p, torch.optim.Optimizer) for p in parts):
        raise TypeError(f"vpipe.attach: optimizer= holds {[type(p).__name__ for p in parts]}; a container "
                        "must hold torch optimizers, one per model part")
    return list(parts)


def optimizer_parts(optimizer: Any, stages: Mapping[int, nn.Module]) -> torch.optim.Optimizer | None:
    """``optimizer`` as vpipe uses it: as given for one optimizer; for several (a list, or a container holding
    ``.optimizers``), a :class:`StageOptimizers` where they all train this rank's one stage (or each stage has
    several), an :class:`OptimizerParts` where each stage has its own (torchtitan's one per model part).

    An optimizer that trains parameters of two stages, beside another that trains one of them, is refused: a
    moved parameter could not tell which of them it belongs to on the next stage. Several optimizers that each
    train every stage of the rank (the Muon recipe over interleaved stages) are one set, and allowed.
    """
    parts = _parts(optimizer)
    if parts is None:
        return optimizer
    if len(parts) == 1 and not isinstance(optimizer, torch.optim.Optimizer):
        return parts[0]
    held = [{id(p) for group in part.param_groups for p in group["params"]} for part in parts]
    owners: dict[int, list[int]] = {}
    for v, module in stages.items():
        mine = {id(p) for p in module.parameters()}
        owners[v] = [i for i, ids in enumerate(held) if ids & mine]
        if not owners[v]:
            raise ValueError(f"vpipe.attach: none of the {len(parts)} optimizers given holds "
                             f"a parameter of stage {v}; pass the optimizers of every stage this rank runs")
    shared = {i for v, mine in owners.items() for i in mine if any(i in owners[w] for w in owners if w != v)}
    one_set = len({tuple(mine) for mine in owners.values()}) == 1  # the same optimizers train every stage
    if shared and not one_set and any(len(mine) > 1 for mine in owners.values()):
        raise ValueError(f"vpipe.attach: optimizer(s) {sorted(shared)} train several of this rank's stages "
                         "while a stage has several optimizers; give each stage its own optimizers (as "
                         "torchtitan builds one per model part), or one set over all of them")
    if len(stages) == 1 or shared:  # one set of optimizers for everything this rank trains
        return StageOptimizers(parts, optimizer)
    merged = [parts[mine[0]] if len(mine) == 1 else StageOptimizers([parts[i] for i in mine]) for mine in
              owners.values()]
    return OptimizerParts(merged, {v: k for k, v in enumerate(owners)}, optimizer)


def raw_optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The trainer's own optimizer objects behind what vpipe reads as one."""
    if isinstance(optimizer, (OptimizerParts, StageOptimizers)):
        return [raw for part in optimizer.parts for raw in raw_optimizers(part)]
    return [] if optimizer is None else [optimizer]


def wrapper_refusal(optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why moves cannot carry this optimizer's state, for a wrapper that keeps state of its own beside its
    param groups (torch.distributed.optim's ZeroRedundancyOptimizer: per-rank shards of the state,
    parameter-to-rank maps); None when they can."""
    for raw in raw_optimizers(optimizer):
        kind = type(raw)
        if kind.__module__.startswith("torch.distributed.optim"):
            return (f"the optimizer is {kind.__module__}.{kind.__name__}, whose per-rank shards and "
                    "parameter-to-rank maps vpipe cannot carry with a block; to let blocks move, "
                    "shard the state with "
                    "FSDP2 instead (fully_shard over the data-parallel mesh: vpipe moves its shards)")
    return None


def group_kinds(optimizer: torch.optim.Optimizer) -> list[str]:
    """The class of the optimizer that holds each of ``optimizer``'s param groups (for several optimizers
    read as one, the part's): a moved parameter joins a group of an optimizer of its own class."""
    owners = {id(group): type(raw).__name__ for raw in raw_optimizers(optimizer)
              for group in raw.param_groups}
    return [owners.get(id(group), type(optimizer).__name__) for group in optimizer.param_groups]


def part_of(optimizer: torch.optim.Optimizer | None, stage: int) -> torch.optim.Optimizer | None:
    """The optimizer that holds ``stage``'s parameters."""
    return optimizer.part(stage) if isinstance(optimizer, OptimizerParts) else optimizer


def _joins(source: torch.optim.Optimizer, target: torch.optim.Optimizer,
           params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """(parameter, its group in ``source``, the group with the same settings in ``target``) per parameter."""
    joins = []
    mine, theirs = group_kinds(source), group_kinds(target)
    for p in params:
        g = next((g for g, group in enumerate(source.param_groups) if any(q is p for q in group["params"])),
                 None)
        if g is not None:
            settings = group_settings(source.param_groups[g], mine[g])
            joins.append((p, g, matching_group(settings, target.param_groups, preferred=g, kinds=theirs,
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
    """Move parameters and their state from ``source`` to ``target`` (a layer moving between two stages of
    this rank whose parts differ), each into the param group there with the settings of the one it leaves.

    Every parameter's group is found before anything is edited, so a
    ``GroupMismatch`` leaves both as they were.
    """
    if source is target or source is None or target is None:
        return
    for p, g, here in _joins(source, target, params):
        state = source.state.pop(p) if p in source.state else None  # read while the group still holds it
        group = source.param_groups[g]["params"]
        group[:] = [q for q in group if q is not p]
        target.param_groups[here]["params"].append(p)
        if state is not None:
            target.state[p] = state
