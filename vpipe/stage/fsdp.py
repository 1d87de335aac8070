"""FSDP2 (``fully_shard``) stages: sharding a block that arrives, and telling the stage's FSDP root.

Under FSDP2 torchtitan's way, every block and the stage module are ``fully_shard``-ed over
the mesh's data-parallel dimension. A move carries each dp rank's *local shards* (see
:mod:`vpipe.migration.state`) to the rank with the same dp coordinate on the neighbouring
stage, which holds the same shard of every parameter once the block is sharded there alike.
So the receiver clones a plain block from a local one (FSDP refuses ``deepcopy``), shards it
with the donor's mesh and options, and copies the shards in.

FSDP's root state (the stage module's) lists, at its lazy initialisation on the first
forward, every FSDP state of its module tree: the post-backward pass that
``torch.distributed.pipelining`` runs at the end of a step walks that list. A block that
arrives or leaves makes the list stale, so the root is put back to "not initialised" and the
next forward initialises it again over the blocks it holds then. Neither step has a public
torch API: the reaches into FSDP's private state are all in this module (checked against
torch 2.13's ``torch/distributed/fsdp/_fully_shard``), so a torch that changes them fails
here, at attach (:func:`fsdp_refusal`), and nowhere else.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

__all__ = ["is_fully_sharded", "fsdp_sharded", "fsdp_refusal", "resharded", "clone_sharded", "FsdpRoot"]

# the private FSDP state vpipe reads or resets (names of torch 2.13)
_STATE_FIELDS = ("_is_root", "_state_ctx", "_fsdp_param_groups", "_states_to_forward_prefetch",
                 "_states_to_backward_prefetch", "_mp_policy")
_GROUP_FIELDS = ("mesh_info", "post_forward_mesh_info", "offload_policy", "_module_fqn")


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` itself."""
    return isinstance(module, FSDPModule)


def fsdp_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is sharded by FSDP2 alone: a DTensor sharded on dim 0 over one mesh dimension, replicated
    over any other (HSDP); a tensor-parallel one is sharded over a second dimension, or strided."""
    if not isinstance(p, DTensor):
        return False
    shards = [pl for pl in p.placements if pl.is_shard()]
    return (len(shards) == 1 and type(shards[0]) is Shard and shards[0].dim == 0
            and all(pl.is_shard() or pl.is_replicate() for pl in p.placements))


def _state(module: nn.Module) -> Any:
    return module._get_fsdp_state()  # type: ignore[operator]  # an FSDPModule's own state object


def fsdp_refusal(stage_module: nn.Module, blocks: Iterable[nn.Module]) -> str | None:
    """Why blocks of this FSDP stage cannot move (None: they can, or the stage is not sharded).

    Moves need torchtitan's layout: ``fully_shard`` on the stage module and on each block by
    itself (nothing sharded inside a block), every parameter sharded on dim 0, and the FSDP
    internals this module resets where torch 2.13 keeps them.
    """
    blocks = list(blocks)
    sharded = [m for m in stage_module.modules() if is_fully_sharded(m)]
    if not sharded:
        return None
    if not is_fully_sharded(stage_module):
        return "FSDP: fully_shard the stage module too (its root state must learn of blocks that move)"
    for block in blocks:
        if not is_fully_sharded(block):
            return "FSDP: a block is not fully_shard-ed by itself (fully_shard every block, as torchtitan does)"
        if any(is_fully_sharded(m) for m in block.modules() if m is not block):
            return "FSDP: fully_shard is applied inside a block; vpipe moves blocks sharded as one unit"
        if not all(fsdp_sharded(p) for p in block.parameters()):
            return "FSDP: a block's parameters are not all sharded on dim 0 by fully_shard alone"
    for module in sharded:
        state = _state(module)
        missing = [f for f in _STATE_FIELDS if not hasattr(state, f)]
        missing += [f"group.{f}" for g in getattr(state, "_fsdp_param_groups", []) for f in _GROUP_FIELDS
                    if not hasattr(g, f)]
        if missing or len(state._fsdp_param_groups) > 1:
            return (f"FSDP: this torch keeps fully_shard's state differently from what vpipe resets "
                    f"({', '.join(missing[:3]) or 'several param groups per module'})")
        if any(g.post_forward_mesh_info not in (None, g.mesh_info) for g in state._fsdp_param_groups):
            return "FSDP: reshard_after_forward as a group size (an int); vpipe shards arriving blocks with a bool"
    return None


def resharded(block: nn.Module) -> nn.Module:
    """``block`` with its parameters sharded (what a move packs); any other block as it is."""
    if is_fully_sharded(block):
        block.reshard()  # type: ignore[operator]  # FSDPModule's public API; nothing happens when already sharded
    return block


def _plain_class(module: nn.Module) -> type[nn.Module]:
    """The class ``fully_shard`` subclassed (it makes ``FSDP<Class>(FSDPModule, Class)``)."""
    return next(c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))


def clone_sharded(donor: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A block like ``donor`` (an FSDP block), sharded with the donor's mesh and options, its tensors uninitialised.

    ``memo`` is :func:`~vpipe.migration.cloning.clone_block`'s (hook tables emptied, calls
    dropped); parameters become plain uninitialised tensors of their full shape (transient:
    ``fully_shard`` keeps this rank's shard) and the composable-API state stays behind, so
    the copy is a plain block that is then sharded like the donor.
    """
    group = _state(donor)._fsdp_param_groups[0]
    params = list(donor.parameters())
    for p in params:
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
    plain = _plain_class(donor)
    clone = plain.__new__(plain)
    fields = {k: v for k, v in donor.__dict__.items() if k not in (STATE_KEY, REGISTRY_KEY)}
    clone.__dict__.update(copy.deepcopy(fields, memo))
    fully_shard(clone, mesh=group.mesh_info.mesh, reshard_after_forward=group.post_forward_mesh_info is not None,
                mp_policy=_state(donor)._mp_policy, offload_policy=group.offload_policy)
    return clone


class FsdpRoot:
    """The FSDP root of one stage module, following the blocks that arrive and leave (a layer listener)."""

    def __init__(self, stage_module: nn.Module, blocks: Mapping[int, nn.Module]) -> None:
        self.module = stage_module
        self.blocks = dict(blocks)

    def add_layer(self, layer_id: int, module: nn.Module) -> None:
        self.blocks[layer_id] = module
        self._forget_initialisation()

    def remove_layer(self, layer_id: int) -> nn.Module | None:
        block = self.blocks.pop(layer_id, None)
        if block is not None and is_fully_sharded(block):
            self._drop_prefetches(_state(block))
        self._forget_initialisation()
        return block

    def retire_layer(self, layer_id: int) -> None:
        """(Streamed PipeDream moves only; FSDP stages never stream.)"""

    def _drop_prefetches(self, leaving: Any) -> None:
        """Remove a leaving block from every state's explicit prefetch lists (``set_modules_to_*_prefetch``)."""
        for module in self.module.modules():
            if is_fully_sharded(module):
                state = _state(module)
                for name in ("_states_to_forward_prefetch", "_states_to_backward_prefetch"):
                    setattr(state, name, [s for s in getattr(state, name) if s is not leaving])

    def _forget_initialisation(self) -> None:
        """Put the root back to "not initialised": its next forward lists the FSDP states it holds then."""
        root = _state(self.module)
        if root._is_root is None:
            return
        states = list(root._state_ctx.all_states)
        for state in states:
            state._is_root = None
            for group in state._fsdp_param_groups:
                group._module_fqn = None  # set again, with the block's new name
        root._state_ctx.all_states.clear()
