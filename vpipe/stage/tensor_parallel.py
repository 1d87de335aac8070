"""Tensor-parallel stages: blocks whose parameters ``parallelize_module`` made DTensors over a tp sub-mesh.

In a ``("pp", "tp")`` mesh (either order) every tp rank of a stage holds its shard of each
block and runs the block's collectives with its tp peers, which hold the same blocks. So
the tp ranks are, to vpipe, replicas of one pipeline (:mod:`vpipe.rank.replicas`): one
planner, one plan applied at one step by all. A move carries each tp rank's *local shards*
(:mod:`vpipe.migration.state`) to the rank with the same tp coordinate on the neighbouring
stage, the only peer in its pipeline group; that rank clones a block of the same kind it
already holds, parallelised alike: DTensor parameters of the same mesh and placements, and
the hooks with which the parallel styles redistribute the block's inputs and outputs
(:func:`parallel_hook_ids`), then loads the shards.

FSDP2's shards are DTensors too; they are told apart by what holds them (the FSDP2 state
on a module, :func:`~vpipe.stage.fsdp.not_fsdp_dtensors`), never by one placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vpipe.compat.torch_distributed import is_parallel_style_hook
from vpipe.compat.torch_internals import call_hook_tables
from vpipe.stage.fsdp import not_fsdp_dtensors

__all__ = ["tensor_parallel_names", "mesh_ranks", "spanning_pipeline", "tensor_parallel_move_refusal",
           "parallel_hook_ids", "keep_parallel_hooks", "empty_dtensor"]


def tensor_parallel_names(module: nn.Module) -> list[str]:
    """The parameters of ``module`` that are tensor-parallel
    DTensors (DTensors FSDP2 does not hold), by name."""
    return not_fsdp_dtensors(module)


def mesh_ranks(t: DTensor) -> set[int]:
    """The world ranks of the mesh ``t`` is placed on."""
    return {int(r) for r in t.device_mesh.mesh.flatten().tolist()}


def spanning_pipeline(module: nn.Module, pipeline_ranks: Sequence[int], me: int) -> list[str]:
    """The tensor-parallel parameters of ``module`` whose mesh holds another rank of this pipeline: sharded
    across stages, which vpipe's stages never are (a tp mesh holds one rank of each pipeline)."""
    others = set(pipeline_ranks) - {me}
    names = set(tensor_parallel_names(module))
    return [n for n, p in module.named_parameters() if n in names
            and mesh_ranks(p) & others]  # type: ignore[arg-type]


def tensor_parallel_move_refusal(blocks: Iterable[nn.Module]) -> str | None:
    """Why tensor-parallel blocks cannot move (None: they can, or none is tensor-parallel).

    With FSDP2 over dp as well (``("pp", "dp", "tp")``) the block is cloned parallelised over tp
    and then sharded over dp as the donor is (:func:`~vpipe.stage.fsdp.clone_sharded`).
    """
    for block in blocks:
        if not tensor_parallel_names(block):
            continue
        if any(isinstance(b, DTensor) for b in block.buffers()):
            return "tensor parallelism: a block holds a DTensor buffer"
    return None


def parallel_hook_ids(module: nn.Module) -> set[Any]:
    """The handle ids of the hooks on ``module`` itself that the parallel styles put
    there: a clone keeps them, so that it redistributes its inputs and outputs as
    the donor does (every other hook stays on the donor)."""
    return {key for table in call_hook_tables(module) for key, fn in table.items()
            if is_parallel_style_hook(fn)}


def keep_parallel_hooks(table: dict[Any, Any], kept: set[Any]) -> dict[Any, Any]:
    """A copy of one hook table (or its flags) that holds only the ``kept`` handles."""
    return type(table)((k, v) for k, v in table.items() if k in kept)


def empty_dtensor(t: DTensor) -> DTensor:
    """An uninitialised DTensor like ``t``: the same mesh, placements, global shape and stride."""
    local = torch.empty_like(t.to_local())
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())
