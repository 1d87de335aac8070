"""The edits of one rank's block containers, and everything that follows a block told of each.

A block that leaves a stage, arrives on it or moves between two stages of one rank is not only
taken out of one container and put into another: the parts that keep per-layer state (its
stage's tensor manager and monitor, the engine's record of the layers: each a
:class:`LayerListener`), the optimizer, the boundary shapes, the weight averages carried with
the blocks (:mod:`.carried`) and the specs a moved block's factory needs must follow, and a
dropped block's leftover references are reported (:mod:`.stale`). The layer manager decides
what moves and when (rounds, votes, adding and removing layers); :class:`BlockEdits` carries out
each edit with all that follows it, so the two jobs are apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any, Protocol

import torch
from torch import nn

from vpipe.migration.carried import CarriedState
from vpipe.migration.handshake import Incoming
from vpipe.migration.moves import Move
from vpipe.migration.shapes import BoundaryShapes
from vpipe.migration.stale import report_stale_references
from vpipe.migration.state import detach_from_optimizer, register_layer
from vpipe.stage.blocks import StageBlocks
from vpipe.stage.optimizers import move_between, part_of

__all__ = ["LayerListener", "BlockEdits"]

Entry = tuple[int, nn.Module, str]  # a block out of its container: (layer id, block, key)


class LayerListener(Protocol):
    """Parts that keep per-layer state (tensor manager, monitor) follow the placement of their stage."""

    def add_layer(self, layer_id: int, module: nn.Module) -> None: ...

    def remove_layer(self, layer_id: int) -> object: ...  # what it returns (the module it let go) is unused

    def retire_layer(self, layer_id: int) -> None:
        """It left the forward path (a streamed move) and stays until its in-flight backwards have run."""


@dataclass(frozen=True)
class BlockEdits:
    """Edits the block containers of this rank's stages (``blocks``, in place), telling each stage's
    ``listeners``, the ``optimizer`` (one, or one part per stage), the boundary ``shapes``, the
    averages in ``carry`` and the ``specs`` (updated in place) of every block that comes and goes.

    Made by the layer manager for each edit from its fields as they are then.
    """

    blocks: Mapping[int, StageBlocks]
    listeners: Mapping[int, Sequence[LayerListener]]
    optimizer: torch.optim.Optimizer | None
    shapes: BoundaryShapes
    carry: CarriedState
    specs: dict[int, Any]

    def take(self, stage: int, layer_ids: Sequence[int]) -> list[Entry]:
        """Take blocks out of a local stage, as (id, block, key): still this rank's (a local move follows)."""
        blocks = self.blocks[stage]
        keys = [blocks.key_of(lid) for lid in layer_ids]
        for lid, listener in product(layer_ids, self.listeners[stage]):
            listener.remove_layer(lid)
        return list(zip(layer_ids, blocks.remove(layer_ids), keys))

    def move(self, move: Move, entries: Sequence[Entry]) -> None:
        """Put blocks taken from ``move.src`` into ``move.dst``, another stage of this rank: their
        parameters change param groups, their averages go with them."""
        move_between(part_of(self.optimizer, move.src), part_of(self.optimizer, move.dst),
                     [p for _, block, _ in entries for p in block.parameters()])
        self._put(move.dst, move.forward, entries)
        self.carry.moved(move.src, move.dst, {lid: block for lid, block, _ in entries})

    def drop(self, stage: int, layer_ids: Sequence[int]) -> None:
        """Let blocks of a local stage go: moved to another rank, or removed."""
        children = self.blocks[stage].blocks()
        for lid in layer_ids:
            detach_from_optimizer(part_of(self.optimizer, stage), children[lid].parameters())
            self.shapes.unwatch(lid)
        self.take(stage, layer_ids)
        self.carry.left(stage, layer_ids)
        report_stale_references(stage, layer_ids, [p for lid in layer_ids
                                                   for p in children[lid].parameters()],
                                [children[lid] for lid in layer_ids])

    def welcome(self, stage: int, layer_id: int, layer: nn.Module) -> None:
        """A block now in ``stage``'s container: its shapes watched, its stage's listeners told."""
        self.shapes.watch(layer_id, layer)
        for listener in self.listeners[stage]:
            listener.add_layer(layer_id, layer)

    def insert(self, inc: Incoming) -> None:
        """Blocks that arrived from another rank, into their stage, with their optimizer state and specs."""
        for st, loaded in zip(inc.states, inc.loaded):
            register_layer(loaded, part_of(self.optimizer, inc.move.dst))
            self.shapes.learn(st.layer_id, st.manifest)
            if st.manifest.get("spec") is not None:
                self.specs[st.layer_id] = st.manifest["spec"]
        keys = {man["layer"]: (man.get("block") or {}).get("key") for man in inc.manifests}
        blocks = self.blocks[inc.move.dst]
        new = [(lid, inc.modules[lid], keys.get(lid) or str(lid)) for lid in inc.move.layers]
        blocks.insert(0 if inc.move.forward else len(blocks.ids), new)
        for lid in inc.move.layers:
            self.welcome(inc.move.dst, lid, inc.modules[lid])
        self.carry.arrived(inc.move.dst, {lid: b for lid, b, _ in new},
                           {ld.layer_id: ld.carried for ld in inc.loaded})

    def _put(self, stage: int, at_front: bool, entries: Sequence[Entry]) -> None:
        blocks = self.blocks[stage]
        blocks.insert(0 if at_front else len(blocks.ids), entries)
        for (lid, layer, _), listener in product(entries, self.listeners[stage]):
            listener.add_layer(lid, layer)
