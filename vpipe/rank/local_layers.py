"""This rank's layers as its stage description holds them: pinned
blocks, and what the monitors report of them.

The stage description (:class:`~vpipe.stage.pipeline.Pipeline`, each local stage's
:class:`~vpipe.stage.blocks.StageBlocks`) exists before the parts ``attach`` builds: the
layer manager edits those containers in place when layers move, and the monitors read them
(through :class:`LocalLayers`) rather than the layer manager, which tells them of the layers
that arrive and leave. So neither needs the other at construction.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping
from typing import Any

from torch import nn

from vpipe.log import decision
from vpipe.stage.beside import averages_of
from vpipe.stage.blocks import StageBlocks
from vpipe.stage.kinds import block_kind
from vpipe.stage.pins import outside_tensors, pin_reason, planner_kind, shared_pins, untrained_pins
from vpipe.stage.pipeline import Pipeline

__all__ = ["LocalLayers", "find_pins"]


def find_pins(pipeline: Pipeline, optimizer: Any = None, carried: Collection[int] = (),
              fixed: Mapping[int, str] | None = None) -> dict[int, str]:
    """The blocks that never move to another rank (shared modules or tensors, parameters that train
    in none of the optimizers given to attach, weight averages beside them other than those
    ``carried``, by id): layer id -> why. Says so in one ``moves_off`` line per stage (blocks with
    user hooks included: they cannot move either, while they have them), and once for the engine's
    ``fixed`` layers that are not blocks (layer id -> why)."""
    outside = {t for s in pipeline.stages if s.blocks is not None
               for t in outside_tensors(s.module, map(s.blocks.module_path, s.blocks.ids))}
    blocks = {lid: b for s in pipeline.stages if s.blocks is not None for lid, b in s.blocks.blocks().items()}
    shared = {**untrained_pins(blocks, optimizer), **averaged_pins(pipeline, carried),
              **shared_pins(blocks, outside)}
    if fixed:
        decision("moves_off",
                 f"stage {pipeline.first.index}: layers {sorted(fixed)} are not blocks: they never move: "
                 + "; ".join(f"layer {lid} {why}" for lid, why in sorted(fixed.items())),
                 stage=pipeline.first.index, layers=sorted(fixed), reason="fixed layers")
    for stage in pipeline.stages:
        mine = stage.blocks.blocks() if stage.blocks is not None else {}
        reasons = {lid: pin_reason(lid, block, shared) for lid, block in mine.items()}
        pinned = {lid: why for lid, why in reasons.items() if why is not None}
        if pinned:
            decision("moves_off",
                     f"stage {stage.index}: layers {sorted(pinned)} never move to another stage: "
                     + "; ".join(f"layer {lid} {why}" for lid, why in sorted(pinned.items())),
                     stage=stage.index, layers=sorted(pinned), reason="pinned blocks")
    return shared


def averaged_pins(pipeline: Pipeline, carried: Collection[int] = ()) -> dict[int, str]:
    """Every block of a stage whose weights a trainer averages beside it (an EMA) without ``carry=``: a
    move would leave the average behind (:mod:`vpipe.stage.beside`)."""
    pins = {}
    for stage in pipeline.stages:
        found = averages_of(stage.module, carried=carried) if stage.blocks is not None else []
        if found:
            why = (f"is averaged beside its stage ({found[0]}): a move would leave its "
                   "average behind (name it in vpipe.attach(..., carry=[...]) and it moves with the blocks)")
            pins.update(dict.fromkeys(stage.blocks.ids, why))  # type: ignore[union-attr]
    return pins


class LocalLayers:
    """The monitors' :class:`~vpipe.monitors.source.LayerFacts` over this rank's block containers.

    ``builds_any``: a layer factory builds whatever arrives; without one the rank can build
    the kinds of block it holds (an arriving block is cloned from one of its kind).
    """

    def __init__(self, blocks: Mapping[int, StageBlocks], shared: Mapping[int, str], *,
                 builds_any: bool) -> None:
        self.blocks = blocks
        self.builds_any = builds_any
        self._kind = planner_kind(shared, self.blocks_by_id)
        # each block's kind, worked out once: asked on every sampled step, and a block's parameter names,
        # shapes and dtypes do not change while it trains
        self._kinds: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

    def layers_of(self, stage: int) -> list[int]:
        return self.blocks[stage].ids

    def blocks_by_id(self) -> dict[int, nn.Module]:
        return {lid: block for stage_blocks in self.blocks.values()
                for lid, block in stage_blocks.blocks().items()}

    def layer_kind(self, block: nn.Module) -> str:
        return self._kind(block)

    def can_build(self) -> list[str] | None:
        if self.builds_any:
            return None
        kinds = set()
        for block in self.blocks_by_id().values():
            kind = self._kinds.get(block)
            if kind is None:
                kind = self._kinds[block] = block_kind(block)
            kinds.add(kind)
        return sorted(kinds)
