"""References to a left block's parameters that the trainer still holds: found and reported once per move.

A trainer often takes ``params = list(model.parameters())`` once, for its own gradient
clipping, an EMA of the weights or a custom weight decay. After a move that list still names
the blocks that left this stage (their tensors no longer train here) and misses the blocks
that arrived, silently. vpipe edits the module and the optimizer in place, so those stay
right; anything else that holds a leaving parameter is found here through the garbage
collector's referrer lists (one scan per move, after it commits: about 30 ms in a process
of 300,000 objects, and a collection more when something holds them) and named in one
``stale_references`` line with what to do instead.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from vpipe.compat.torch_internals import parameter_table
from vpipe.log import decision

__all__ = ["stale_holders", "report_stale_references"]

_CONTAINERS = (list, tuple, dict, set, frozenset)


def _describe(holder: Any, leaving: set[int]) -> str:
    values = holder.values() if isinstance(holder, dict) else holder
    held = sum(1 for v in values if id(v) in leaving)
    keys = holder.keys() if isinstance(holder, dict) else ()
    held += sum(1 for k in keys if id(k) in leaving)
    return f"a {type(holder).__name__} of {len(holder)} ({held} of them leaving)"


def stale_holders(params: Sequence[torch.Tensor], blocks: Iterable[nn.Module]) -> list[str]:
    """What outside the blocks themselves holds one of ``params`` (the parameters of blocks
    leaving the stage): lists, tuples, dicts and sets of the trainer's, or objects of its
    own classes. Frames (local variables of a running call), torch's and vpipe's own
    objects are not the trainer's references and are left out."""
    own = {id(m.__dict__) for block in blocks for m in block.modules()}
    own |= {id(parameter_table(m)) for block in blocks for m in block.modules()}
    leaving = {id(p) for p in params}
    found = _scan(params, own, leaving)
    if found:  # a holder dropped in a reference cycle is not the trainer's any more: collect, then look again
        gc.collect()
        found = _scan(params, own, leaving)
    return found


def _library(obj: Any) -> bool:
    return type(obj).__module__.startswith(("torch", "vpipe"))


def _library_attributes(holder: Any) -> bool:
    """Whether ``holder`` is the attribute table of torch's or vpipe's own object (FSDP2's per-parameter
    state of a leaving block keeps its parameter so): not a reference of the trainer's."""
    return isinstance(holder, dict) and any(
        _library(owner) and getattr(owner, "__dict__", None) is holder for owner in gc.get_referrers(holder))


def _scan(params: Sequence[torch.Tensor], own: set[int], leaving: set[int]) -> list[str]:
    found = []
    for holder in gc.get_referrers(*params):
        if id(holder) in own or holder is params or isinstance(holder, (types.FrameType, types.CellType)):
            continue
        if isinstance(holder, _CONTAINERS):
            if not _library_attributes(holder):
                found.append(_describe(holder, leaving))
        elif not _library(holder):
            found.append(f"a {type(holder).__qualname__} object")
    return sorted(found)


def report_stale_references(stage: int, layer_ids: Sequence[int], params: Sequence[torch.Tensor],
                            blocks: Iterable[nn.Module]) -> list[str]:
    """Log one ``stale_references`` line when something outside the model and the optimizer still holds the
    parameters of layers that left ``stage``; returns what holds them."""
    holders = stale_holders(params, blocks) if params else []
    if holders:
        decision("stale_references",
                 f"stage {stage}: {len(holders)} reference(s) outside the model and the optimizer still hold "
                 f"parameters of layers {list(layer_ids)}, which left this stage: {'; '.join(holders[:4])}. "
                 "They no longer train here, and blocks that arrive are missing from them: take the "
                 "parameters from model.parameters() or optimizer.param_groups when you use them, not once "
                 "before training",
                 stage=stage, layers=list(layer_ids), count=len(holders), holders=holders[:16])
    return holders
