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
torch API: the reaches into FSDP's private state are in :mod:`vpipe.compat.torch_distributed`
(checked against torch 2.13's ``torch/distributed/fsdp/_fully_shard``), and a torch that
changes them fails here, at attach (:func:`fsdp_refusal`), and nowhere else.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import empty as dtensor_empty

from vpipe.compat.torch_distributed import (
    COMPOSABLE_KEYS,
    drop_fsdp_prefetch,
    forget_fsdp_root,
    fsdp_internals_missing,
    fsdp_mp_policy,
    fsdp_param_groups,
    fsdp_state,
    is_strided_shard,
)

__all__ = ["is_fully_sharded", "fsdp_sharded", "fsdp_with_tensor_parallel", "not_fsdp_dtensors",
           "fsdp_refusal",
           "resharded", "clone_sharded", "shard_like", "unsharded_class", "unsharded_placeholders",
           "FsdpRoot"]


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


def not_fsdp_dtensors(module: nn.Module) -> list[str]:
    """The DTensor parameters of ``module`` that are not FSDP2's shards, by name: a parameter is
    FSDP2's when ``fully_shard`` was applied to a module that holds it (its FSDP2 state) and it is
    sharded on dim 0 over one mesh dimension alone (:func:`fsdp_sharded`). A ``Shard(0)`` placement by
    itself is no proof: a ``ColwiseParallel`` weight has it too."""
    managed = {id(p) for m in module.modules() if is_fully_sharded(m) for p in m.parameters()}
    return [name for name, p in module.named_parameters()
            if isinstance(p, DTensor) and not (id(p) in managed and fsdp_sharded(p))]


def fsdp_refusal(stage_module: nn.Module, blocks: Iterable[nn.Module]) -> str | None:
    """Why blocks of this FSDP stage cannot move (None: they can, or the stage is not sharded).

    Moves need torchtitan's layout: ``fully_shard`` on the stage module and on each block by
    itself (nothing sharded inside a block), every parameter sharded on dim 0, and the FSDP
    internals vpipe resets where torch 2.13 keeps them (:mod:`vpipe.compat.torch_distributed`).
    """
    blocks = list(blocks)
    sharded = [m for m in stage_module.modules() if is_fully_sharded(m)]
    if not sharded:
        return None
    if not is_fully_sharded(stage_module):
        return "FSDP: fully_shard the stage module too (its root state must learn of blocks that move)"
    for block in blocks:
        if not is_fully_sharded(block):
            return ("FSDP: a block is not fully_shard-ed by itself (fully_shard every "
                    "block, as torchtitan does)")
        if any(is_fully_sharded(m) for m in block.modules() if m is not block):
            return "FSDP: fully_shard is applied inside a block; vpipe moves blocks sharded as one unit"
        if not all(fsdp_sharded(p) or fsdp_with_tensor_parallel(p) for p in block.parameters()):
            return "FSDP: a block's parameters are not all sharded on dim 0 by fully_shard alone"
    for module in sharded:
        state = fsdp_state(module)
        missing = fsdp_internals_missing(state)
        groups = fsdp_param_groups(state)
        if missing or len(groups) > 1:
            return (f"FSDP: this torch keeps fully_shard's state differently from what vpipe resets "
                    f"({', '.join(missing[:3]) or 'several param groups per module'})")
        if any(g.post_forward_mesh_info not in (None, g.mesh_info) for g in groups):
            return ("FSDP: reshard_after_forward as a group size (an int); vpipe shards "
                    "arriving blocks with a bool")
    return None


def resharded(block: nn.Module) -> nn.Module:
    """``block`` with its parameters sharded (what a move packs); any other block as it is."""
    if is_fully_sharded(block):
        # FSDPModule's public API; nothing happens when already sharded
        block.reshard()  # type: ignore[operator]
    return block


def _before_sharding(p: torch.Tensor, dp_mesh: Any) -> torch.Tensor:
    """What ``fully_shard`` found in ``p``'s place, uninitialised: a plain tensor of the full shape, or, for a
    tensor-parallel block, the DTensor over the mesh's other dimensions (tp) that it sharded over dp."""
    if not isinstance(p, DTensor):
        return torch.empty(p.shape, dtype=p.dtype, device=p.device)
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or ()
    dp_names = set(dp_mesh.mesh_dim_names or ())
    rest = [i for i, name in enumerate(names) if name not in dp_names]
    if not rest or len(rest) == len(names):
        return torch.empty(p.shape, dtype=p.dtype, device=p.device)
    tp_mesh = mesh[tuple(names[i] for i in rest)] if len(rest) > 1 else mesh[names[rest[0]]]
    return dtensor_empty(p.shape, dtype=p.dtype, device_mesh=tp_mesh,
                         placements=[p.placements[i] for i in rest])


def fsdp_with_tensor_parallel(p: torch.Tensor) -> bool:
    """Whether ``p`` is sharded by FSDP2 over dp and by tensor parallelism over the other named dimensions of
    its mesh (``("dp", "tp")``, torchtitan's 3-D layout): one ``Shard`` or ``_StridedShard`` per dimension."""
    if not isinstance(p, DTensor) or p.device_mesh.ndim < 2 or not p.device_mesh.mesh_dim_names:
        return False
    return all(pl.is_shard() or pl.is_replicate() or is_strided_shard(pl) for pl in p.placements)


def unsharded_class(module: nn.Module) -> type[nn.Module]:
    """The class ``fully_shard`` subclassed (it makes ``FSDP<Class>(FSDPModule, Class)``)."""
    return next(c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))


def unsharded_placeholders(donor: nn.Module) -> dict[int, nn.Parameter]:
    """For each parameter of ``donor`` (an FSDP block), what ``fully_shard`` found in its place, uninitialised
    (transient: ``fully_shard`` keeps this rank's shard), by the id of the donor's parameter."""
    mesh = fsdp_param_groups(fsdp_state(donor))[0].mesh_info.mesh
    return {id(p): nn.Parameter(_before_sharding(p, mesh), requires_grad=p.requires_grad)
            for p in donor.parameters()}


def shard_like(donor: nn.Module, clone: nn.Module) -> nn.Module:
    """``clone`` (a plain block) ``fully_shard``-ed with the mesh and options of ``donor`` (an FSDP block)."""
    group = fsdp_param_groups(fsdp_state(donor))[0]
    fully_shard(clone, mesh=group.mesh_info.mesh,
                reshard_after_forward=group.post_forward_mesh_info is not None,
                mp_policy=fsdp_mp_policy(fsdp_state(donor)), offload_policy=group.offload_policy)
    return clone


def clone_sharded(donor: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A block like ``donor`` (an FSDP block), sharded with the donor's
    mesh and options, its tensors uninitialised.

    ``memo`` is :func:`~vpipe.migration.cloning.clone_block`'s (hook tables emptied, calls
    dropped); parameters become :func:`unsharded_placeholders` and the composable-API state stays behind, so
    the copy is a plain block that is then sharded like the donor.
    """
    memo.update(unsharded_placeholders(donor))
    plain = unsharded_class(donor)
    clone = plain.__new__(plain)
    fields = {k: v for k, v in donor.__dict__.items() if k not in COMPOSABLE_KEYS}
    clone.__dict__.update(copy.deepcopy(fields, memo))
    return shard_like(donor, clone)


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
            self._drop_prefetches(fsdp_state(block))
        self._forget_initialisation()
        return block

    def retire_layer(self, layer_id: int) -> None:
        """(Streamed PipeDream moves only; FSDP stages never stream.)"""

    def _drop_prefetches(self, leaving: Any) -> None:
        """Remove a leaving block from every state's explicit
        prefetch lists (``set_modules_to_*_prefetch``)."""
        for module in self.module.modules():
            if is_fully_sharded(module):
                drop_fsdp_prefetch(fsdp_state(module), leaving)

    def _forget_initialisation(self) -> None:
        """Put the root back to "not initialised": its next forward lists the FSDP states it holds then."""
        forget_fsdp_root(fsdp_state(self.module))
