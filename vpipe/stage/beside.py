"""State a trainer keeps beside its stage, per block, that a move would leave behind: weight averages.

An exponential moving average of the weights (torch's ``AveragedModel``, or a dict of clones
keyed by parameter name) holds its own copy of every block of the stage. A move takes the block
and its optimizer state to another stage and leaves that copy behind: the average of a moved
block freezes on the old stage and, on the new one, an ``AveragedModel`` fails on the size of its
parameter list while a name-keyed dict starts over from the moved weights. An average named in
``vpipe.attach(..., carry=[...])`` moves with its blocks (:mod:`vpipe.migration.carried`); a stage
with one that is not carried keeps its blocks (pinned), and attach says so in one line rather than
let the average go silently wrong. Found by looking, at attach, for ``AveragedModel`` instances
whose parameters are named as the stage module's, and for dicts of tensors keyed by the stage
module's parameter names.
"""

from __future__ import annotations

import gc
from collections.abc import Collection, Iterable
from typing import cast

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

__all__ = ["averages_of"]

_MIN_SHARE = 0.5  # a dict naming at least this share of the stage's parameters is an average of them


def averages_of(module: nn.Module, objects: Iterable[object] | None = None, carried: Collection[int] = ()
                ) -> list[str]:
    """What keeps a per-block copy of ``module``'s weights (descriptions for
    the run log), among ``objects`` (default: every object the garbage
    collector tracks) other than those ``carried`` (their ids)."""
    names = {name for name, _ in module.named_parameters()}
    own = {id(p) for p in module.parameters()}
    if not names:
        return []
    found = []
    for obj in gc.get_objects() if objects is None else objects:
        if id(obj) in carried:
            continue
        if issubclass(type(obj), AveragedModel):  # type(), not isinstance: no deprecated proxy's __class__
            averaged = cast(AveragedModel, obj).module
            theirs = {name for name, _ in averaged.named_parameters()}
            if averaged is not module and theirs == names:
                found.append(f"an AveragedModel of it ({type(averaged).__name__}, {len(theirs)} parameters)")
        elif type(obj) is dict and len(obj) >= _MIN_SHARE * len(names) and _is_named_copy(obj, names, own):
            found.append(f"a dict of {len(obj)} tensors keyed by its parameter names")
    return found


def _is_named_copy(candidate: dict[object, object], names: set[str], own: set[int]) -> bool:
    """Plain tensors under the module's parameter names, not its parameters themselves nor any module's (a
    trainer's own ``dict(model.named_parameters())`` is a view of some model, not a copy)."""
    shared = [value for key, value in candidate.items() if isinstance(key, str) and key in names]
    return len(shared) >= _MIN_SHARE * len(names) and all(
        isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and id(value) not in own
        for value in shared)
