"""Which param group a layer added while training (``vp.add_layers``) trains in.

A trainer keeps its parameters in groups by a rule of its own (decay and no-decay by name; Muon
for a block's matrices, AdamW for the rest; a group of its own for the embeddings), which vpipe
cannot read. What it can read is where the blocks already there train: a new block's parameter
joins the group whose settings its namesake in the nearest block of the same class, in model
order, trains with (on whichever rank that block is). Placement must not decide it: the same
edit after different moves would otherwise train a parameter differently. Every rank publishes
its blocks' group settings (:func:`group_table`); the stage that builds the block looks them up
(:func:`join_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vpipe.stage.blocks import StageBlocks
from vpipe.stage.groups import group_settings, matching_group
from vpipe.stage.optimizers import group_kinds, part_of

__all__ = ["group_table", "join_groups"]


def group_table(blocks: Mapping[int, StageBlocks], optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Per block of this rank (by id): its class and the settings of
    the group each of its parameters trains in."""
    table: dict[str, Any] = {}
    for stage, stage_blocks in blocks.items():
        part = part_of(optimizer, stage)
        if part is None:
            continue
        kinds = group_kinds(part)
        where = {id(p): g for g, group in enumerate(part.param_groups) for p in group["params"]}
        for lid, block in stage_blocks.blocks().items():
            trained = {name: where[id(p)] for name, p in block.named_parameters() if id(p) in where}
            table[str(lid)] = {"class": type(block).__qualname__, "params": {
                name: group_settings(part.param_groups[g], kinds[g]) for name, g in trained.items()}}
    return table


def join_groups(optimizer: torch.optim.Optimizer | None, layer: nn.Module, layer_id: int,
                order: Sequence[int],
                table: Mapping[str, Any]) -> list[tuple[torch.Tensor, int]]:
    """(parameter, index of the group it joins) for each parameter of the new ``layer`` that
    trains: the group with the settings its namesake trains with in the nearest block of its class
    in model ``order`` (every rank's blocks in ``table``). A parameter without a trained namesake
    joins group 0 if it trains, else none. Raises ``GroupMismatch`` (before anything is edited)
    when this stage's optimizer has no group with those settings."""
    if optimizer is None:
        return []
    at = list(order).index(layer_id)
    cls = type(layer).__qualname__
    alike = sorted((i for i, lid in enumerate(order) if lid != layer_id
                    and table.get(str(lid), {}).get("class")
                    == cls), key=lambda i: (abs(i - at), i))
    theirs = table[str(order[alike[0]])]["params"] if alike else {}
    kinds = group_kinds(optimizer)
    joins: list[tuple[torch.Tensor, int]] = []
    for name, p in layer.named_parameters():
        settings = theirs.get(name)
        if settings is not None:
            joins.append((p, matching_group(settings, optimizer.param_groups, preferred=None, kinds=kinds,
                                            what=f"layer {layer_id}'s {name}")))
        elif p.requires_grad:
            joins.append((p, 0))
    return joins
