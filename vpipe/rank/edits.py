"""Changing the model while it trains (neural architecture search): adding and removing layers.

An edit is collective and happens between steps: every rank makes the same call at the
same step boundary (checked through the store before anything changes), the layer
manager edits the placement and the stage that owns the position, and then every rank
commits a new plan epoch over the changed layers, the policies carried over (plans made
for the old layers become stale), and redoes torch's shape inference (new layers have
never run).
"""

from __future__ import annotations

import json
from typing import Any

from vpipe.migration.namesakes import group_table
from vpipe.plan import Plan
from vpipe.rank.agreement import StoreAgreement
from vpipe.rank.parts import RankParts
from vpipe.rank.steps import StepDriver
from vpipe.stage.fsdp import is_fully_sharded

__all__ = ["LayerEdits"]


class LayerEdits:
    def __init__(self, parts: RankParts, *, agreement: StoreAgreement, driver: StepDriver, has_factory: bool,
                 refusal: str | None, who: str) -> None:
        self.parts = parts
        self.refusal = refusal  # the engine's capabilities: why these layers cannot be edited, or None
        self.agreement = agreement
        self.driver = driver
        self.has_factory = has_factory
        self.who = who

    def add_layers(self, position: int, specs: list[Any]) -> list[int]:
        """Insert layers before model position ``position`` (every
        rank calls it at the same step boundary)."""
        self._require_boundary("add_layers")
        if not self.has_factory:
            raise RuntimeError("add_layers needs layer_factory= in the vpipe config to build the new layers")
        if any(is_fully_sharded(stage.module) for stage in self.parts.pipeline.stages):
            raise RuntimeError("add_layers cannot add to an FSDP2 (fully_shard) stage: the "
                               "factory's blocks would not "
                               "be sharded, nor their gradients reduced over the data-parallel group")
        self.agreement.agree_edit({"call": "add_layers", "position": position, "count": len(specs)}, self.who)
        manager = self.parts.layer_manager
        # where every rank's blocks train: a new block's parameters
        # join their namesakes' groups, wherever they are
        key = f"add_groups/{self.parts.plan_in_force.epoch}/{{}}"
        self.agreement.set(key.format(self.agreement.rank),
                           json.dumps(group_table(manager.blocks, manager.optimizer)))
        namesakes = {lid: entry for raw in self.agreement.gather(key, range(self.agreement.world_size),
                                                                 "add_layers",
                                                                 self.who)
                     for lid, entry in json.loads(raw).items()}
        new_ids, placement = manager.add_layers(self.parts.plan_in_force.placement, position, specs,
                                                namesakes)
        # a stage's output is its last layer's: shapes are inferred again only where a new layer
        # (never run, its output unknown) ends a stage. Inference runs the stage's forward and
        # the loss once more, which a trainer without vpipe would not (a loss that counts its
        # calls saw it: found by the fuzzer's GradScaler axis)
        added = set(new_ids)
        self._after_edit(placement, reshape=any(stage and stage[-1] in added for stage in placement))
        return new_ids

    def remove_layers(self, layer_ids: list[int]) -> None:
        """Remove layers by id (every rank calls it at the same step boundary)."""
        self._require_boundary("remove_layers")
        self.agreement.agree_edit({"call": "remove_layers", "layers": sorted(int(lid) for lid in layer_ids)},
                                  self.who)
        # shapes are inferred again only where a boundary changes: inference runs the stage's forward (and the
        # user's hooks) once more, which a trainer without vpipe would not
        reshape, placement = self.parts.layer_manager.remove_layers(self.parts.plan_in_force.placement,
                                                                    layer_ids)
        self._after_edit(placement, reshape=reshape)

    def _require_boundary(self, what: str) -> None:
        counter = self.driver.counter
        if self.driver.in_step or (counter is not None and counter.next_mb > 0):
            raise RuntimeError(
                f"{what} must be called between steps (after optimizer.step()), not inside one"
            )
        unsettled = self.parts.engine.unsettled()
        if unsettled is not None:
            raise RuntimeError(f"{what} on {unsettled}")
        if self.refusal is not None:
            raise RuntimeError(f"{what} cannot edit {self.refusal}")

    def _after_edit(self, placement: tuple[tuple[int, ...], ...], reshape: bool = True) -> None:
        # a new epoch: plans made for the old layers become stale, stats say which layers they measured
        owner = self.parts.plan_in_force
        kept = {lid for layers in placement for lid in layers}
        policies = {lid: p for lid, p in owner.plan.policies.items() if lid in kept}
        owner.commit(Plan(epoch=owner.epoch + 1, stages=placement, policies=policies), "edited")
        if reshape:
            self.parts.engine.reset_shapes()  # new layers have never run: redo shape inference
