"""One weight average kept beside a stage, per block: what a move takes out of it, sends and puts back.

Two shapes are carried (``vpipe.attach(..., carry=[...])``): torch's ``AveragedModel`` of the
stage module, whose ``.module`` holds an averaged copy of every block in a container at the
stage's own path, and a dict of tensors keyed by the stage module's parameter names
(``"layers.4.up.weight"``). Both are edited in place, like the stage's block container: an
``AveragedModel`` gains and loses the averaged copies of blocks in its container at the
blocks' positions (its parameters stay in the stage module's order, which its
``update_parameters`` zips with the model's), a dict gains and loses keys. Neither's
``n_averaged`` or other entries change.

The block container is edited first (the layer manager's), the average after it: what left the
stage since the last edit is taken out and *held* (:meth:`Average.sync`) until the move says
where it goes, and a dict's keys follow blocks whose names changed (a positional container is
renumbered after each edit).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from vpipe.migration.cloning import clone_block
from vpipe.stage.blocks import StageBlocks

__all__ = ["Average", "AveragedCopy", "NamedCopy", "Tensors"]

Tensors = dict[str, torch.Tensor]  # a block's averaged tensors by their names in the block


class Average(abc.ABC):
    """A weight average of one stage's module, followed block by block (see the module docstring)."""

    kind = "average"

    def __init__(self, blocks: StageBlocks) -> None:
        self.stage_blocks = blocks  # the stage's own container, edited by the layer manager
        self.held: dict[int, Any] = {}  # what left the stage and has not been dropped or put back yet

    def sync(self) -> None:  # noqa: B027 - nothing to catch up with by default
        """Catch up with the stage's container: hold what left it, follow what was renamed."""

    @abc.abstractmethod
    def tensors(self, layer_id: int) -> Tensors:
        """The block's averaged tensors (the sender's part of a move's payload)."""

    @abc.abstractmethod
    def put(self, layer_id: int, block: nn.Module, value: Any) -> None:
        """Give the block (already in the stage's container) its average: held here, received
        (``Tensors``), or None (a new block: its own weights, as an average starts)."""

    def _position(self, layer_id: int, present: list[int]) -> int:
        ids = self.stage_blocks.ids
        before = set(ids[:ids.index(layer_id)])
        return sum(1 for lid in present if lid in before)


class AveragedCopy(Average):
    """torch's ``AveragedModel`` of the stage module: its container of averaged blocks mirrors the stage's."""

    kind = "AveragedModel"

    def __init__(self, averaged: AveragedModel, blocks: StageBlocks) -> None:
        super().__init__(blocks)
        self.averaged = averaged
        module = averaged.module
        container = module.get_submodule(blocks.path) if blocks.path else module
        self.mirror = StageBlocks(container, blocks.ids, blocks.style, blocks.path)

    def sync(self) -> None:
        here = set(self.stage_blocks.ids)
        gone = [lid for lid in self.mirror.ids if lid not in here]
        if gone:
            self.held.update(zip(gone, self.mirror.remove(gone)))

    def tensors(self, layer_id: int) -> Tensors:
        block = self.mirror.blocks()[layer_id]
        return {name: t.detach() for name, t in [*block.named_parameters(), *block.named_buffers()]}

    def put(self, layer_id: int, block: nn.Module, value: Any) -> None:
        self.sync()
        device = _device([*self.averaged.module.parameters(), *self.averaged.module.buffers()], block)
        if isinstance(value, nn.Module):  # held: a move between two stages of this rank
            copy = value.to(device)
        else:
            copy = clone_block(block).to(device)
            source = dict(value) if value is not None else {
                name: t.detach() for name, t in [*block.named_parameters(), *block.named_buffers()]}
            targets = dict([*copy.named_parameters(), *copy.named_buffers()])
            if set(source) != set(targets):
                raise ValueError(f"layer {layer_id}'s average has tensors "
                                 f"{sorted(source)[:4]}, its block here {sorted(targets)[:4]}")
            with torch.no_grad():
                for name, t in targets.items():
                    t.copy_(source[name])
        at = self._position(layer_id, self.mirror.ids)
        self.mirror.insert(at, [(layer_id, copy, self.stage_blocks.key_of(layer_id))])


class NamedCopy(Average):
    """A dict of tensors keyed by the stage module's parameter (or buffer) names."""

    kind = "dict"

    def __init__(self, values: dict[str, torch.Tensor], blocks: StageBlocks) -> None:
        super().__init__(blocks)
        self.values = values
        self.paths = {lid: blocks.module_path(lid) for lid in blocks.ids}  # where each block's keys are now

    def _pop(self, path: str) -> Tensors:
        prefix = path + "."
        return {key[len(prefix):]: self.values.pop(key)
                for key in [k for k in self.values if k.startswith(prefix)]}

    def sync(self) -> None:
        here = set(self.stage_blocks.ids)
        moved: dict[int, Tensors] = {}
        for lid, path in list(self.paths.items()):
            if lid not in here:
                self.held[lid] = self._pop(path)
                del self.paths[lid]
            # renumbered: every renamed block out first, then in
            elif self.stage_blocks.module_path(lid) != path:
                moved[lid] = self._pop(path)
        for lid, entries in moved.items():
            self._add(lid, entries)

    def _add(self, layer_id: int, entries: Mapping[str, torch.Tensor]) -> None:
        path = self.paths[layer_id] = self.stage_blocks.module_path(layer_id)
        self.values.update((f"{path}.{name}", t) for name, t in entries.items())

    def tensors(self, layer_id: int) -> Tensors:
        prefix = self.paths[layer_id] + "."
        return {key[len(prefix):]: t.detach() for key, t in self.values.items() if key.startswith(prefix)}

    def put(self, layer_id: int, block: nn.Module, value: Any) -> None:
        self.sync()
        if value is None:  # a new block: its weights, as the trainer's clones began
            value = {name: p.detach().clone() for name, p in block.named_parameters()}
        else:  # where the dict keeps its other tensors
            device = _device(list(self.values.values()), block)
            value = {name: t.to(device) for name, t in value.items()}
        self._add(layer_id, value)


def _device(tensors: list[torch.Tensor], block: nn.Module) -> torch.device:
    """Where an average keeps its tensors: where it keeps the others, else where the block is."""
    first = next(iter([*tensors, *block.parameters(), *block.buffers()]), None)
    return first.device if first is not None else torch.device("cpu")
