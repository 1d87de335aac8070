"""Writing a received block's tensors into the block built for it here (:mod:`.state` unpacks the payload).

Parameters are copied into in place (an FSDP2 shard's local tensor is a view of the storage FSDP
keeps, and the optimizer holds the parameter objects); a plain buffer is replaced by a new tensor
instead, since a PipeDream hand-over loads a block whose copy here already ran forwards whose
backwards saved the old buffers; gradients and optimizer state of a sharded parameter become
DTensors like it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vpipe.compat.torch_internals import view_base

__all__ = ["DTYPES", "dtype_name", "lookup", "sharding_matches", "like_owner", "load_grad", "load_buffer",
           "load_tensor"]

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"cannot migrate tensors of dtype {dtype}")
    return name


def lookup(table: Mapping[str, torch.Tensor], name: str, layer_id: int, what: str) -> torch.Tensor:
    if name not in table:
        raise ValueError(f"layer {layer_id}: the built module has no {what} {name!r}")
    return table[name]


def sharding_matches(target: torch.Tensor, entry: dict[str, Any], layer_id: int) -> None:
    if isinstance(target, DTensor) != bool(entry.get("shard", False)):
        here, there = ("sharded", "whole") if isinstance(target, DTensor) else ("whole", "sharded")
        raise ValueError(f"layer {layer_id}: {entry['name']} is {here} here but {there} on the sender (shard "
                         "every stage's blocks alike)")


def like_owner(value: torch.Tensor, owner: torch.Tensor, entry: dict[str, Any],
               layer_id: int) -> torch.Tensor:
    """An optimizer state shard as the DTensor its sharded parameter's state is (else ``value`` as it is)."""
    if not entry.get("shard", False):
        return value
    sharding_matches(owner, entry, layer_id)
    assert isinstance(owner, DTensor)
    if list(owner.to_local().shape) != list(value.shape):
        raise ValueError(f"layer {layer_id}: optimizer state {entry['key']!r} of "
                         f"{entry['name']} is a shard of {tuple(value.shape)}, the parameter's shard here is "
                         f"{tuple(owner.to_local().shape)}")
    return DTensor.from_local(value, owner.device_mesh, owner.placements, run_check=False, shape=owner.shape,
                              stride=owner.stride())


def load_grad(owner: torch.Tensor, value: torch.Tensor, entry: dict[str, Any], layer_id: int) -> None:
    """Give a fresh block's parameter the gradient its sender had pending, sharded like the parameter."""
    local = owner.to_local() if isinstance(owner, DTensor) else owner
    if list(local.shape) != entry["shape"] or local.dtype != value.dtype:
        raise ValueError(f"layer {layer_id}: the gradient of {entry['name']} is {tuple(entry['shape'])} "
                         f"{entry['dtype']}, its parameter here {tuple(local.shape)} {local.dtype}")
    owner.grad = like_owner(value.to(local.device), owner, entry, layer_id)


def load_buffer(module: nn.Module, target: torch.Tensor, value: torch.Tensor, entry: dict[str, Any],
                 layer_id: int) -> None:
    """A plain buffer takes the sender's values as a new tensor: a PipeDream hand-over loads a block whose
    copy here already ran forwards, and backwards still to come saved its old buffers (BatchNorm's running
    statistics), which an in-place copy made fail ("modified by an inplace operation")."""
    path, _, leaf = entry["name"].rpartition(".")
    owner = module.get_submodule(path)
    if isinstance(target, DTensor) or getattr(owner, leaf, None) is not target or _aliased(module, target):
        # sharded, or sharing memory with another tensor: in place
        load_tensor(target, value, entry, layer_id)
        return
    _same_kind(target, entry, layer_id)
    fresh = target.detach().clone()  # the same layout (strides) as the block built here
    fresh.copy_(value)
    setattr(owner, leaf, fresh)


def _aliased(module: nn.Module, target: torch.Tensor) -> bool:
    """Whether ``target`` shares memory with another tensor of the block (a view of a buffer, or a buffer held
    under two names): a new tensor would cut the tie, so such buffers are copied into."""
    if view_base(target) is not None:
        return True
    where = target.untyped_storage().data_ptr()
    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    others = [t for _, t in named]
    return any(t is not target and t.untyped_storage().data_ptr() == where for t in others
               if not isinstance(t, DTensor) and t.device == target.device)


def load_tensor(target: torch.Tensor, value: torch.Tensor, entry: dict[str, Any], layer_id: int) -> None:
    sharding_matches(target, entry, layer_id)
    with torch.no_grad():  # a shard's local tensor is a view of the storage FSDP keeps: copied into in place
        local = target.to_local() if isinstance(target, DTensor) else target
        _same_kind(local, entry, layer_id)
        local.copy_(value)


def _same_kind(local: torch.Tensor, entry: dict[str, Any], layer_id: int) -> None:
    if list(local.shape) != entry["shape"] or local.dtype != DTYPES[entry["dtype"]]:
        raise ValueError(f"layer {layer_id}: {entry['name']} is {tuple(local.shape)} {local.dtype} here "
                         f"but {tuple(entry['shape'])} {entry['dtype']} on the sender")
