"""Building a block that arrives without a layer factory: its kind, its plain attributes, an empty clone.

A receiving stage clones one of its own blocks of the same *kind* (class, parameter and
buffer names, shapes, dtypes), gives the clone the moved block's plain attributes (a layer
index, a window flag) and then loads the moved tensors into it (:mod:`.state`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vpipe.compat.torch_internals import MODULE_INTERNALS, call_hook_tables
from vpipe.stage.compiled import compile_like, compiled_forwards
from vpipe.stage.fsdp import (
    clone_sharded,
    is_fully_sharded,
    shard_like,
    unsharded_class,
    unsharded_placeholders,
)
from vpipe.stage.kinds import block_kind, compiled_inner
from vpipe.stage.tensor_parallel import empty_dtensor, keep_parallel_hooks, parallel_hook_ids
from vpipe.tensor_manager import is_routed_forward

__all__ = ["clone_block", "block_attrs", "set_block_attrs", "block_info", "validate_block_info"]

_PLAIN = (bool, int, float, str, type(None))
# how a module is called, never a plain attribute (torch's compiled call is internal)
_CALLS = frozenset({"forward"})
_MAX_ATTRS = 512
_MAX_TEXT = 256


def _is_plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return not isinstance(value, str) or len(value) <= _MAX_TEXT
    if isinstance(value, (tuple, list)) and depth < 2 and len(value) <= 64:
        return all(_is_plain(v, depth + 1) for v in value)
    return False


def block_attrs(block: nn.Module) -> dict[str, dict[str, Any]]:
    """The block's plain attributes (numbers, strings, booleans, None, short tuples of them) by submodule.

    These are what blocks of one class may differ in (a layer index, a sliding-window
    flag); they travel with a moved block and are set on the clone that receives it.
    Everything else (tensors aside) comes from the receiving stage's block of that class.
    """
    attrs: dict[str, dict[str, Any]] = {}
    for name, module in block.named_modules():
        if compiled_inner(module) is not None:
            continue  # the compile wrapper's own attributes (its ids) are not the block's
        mine = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(module).items()
                if k not in MODULE_INTERNALS and k not in _CALLS and _is_plain(v)}
        if mine:
            attrs[name] = mine
    return attrs


def validate_attrs(raw: Any, layer_id: int) -> dict[str, dict[str, Any]]:
    """Check attributes that came from another rank before any of them is set."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > _MAX_ATTRS:
        raise ValueError(f"layer {layer_id}: block attributes must be a map of at most "
                         f"{_MAX_ATTRS} submodules")
    for sub, values in raw.items():
        if (
            not isinstance(sub, str)
            or len(sub) > _MAX_TEXT
            or not isinstance(values, dict)
            or len(values) > _MAX_ATTRS
        ):
            raise ValueError(f"layer {layer_id}: bad block attributes for submodule {sub!r:.80}")
        for key, value in values.items():
            if not isinstance(key, str) or not key.isidentifier() or key in MODULE_INTERNALS or key in _CALLS:
                raise ValueError(f"layer {layer_id}: bad block attribute name {key!r:.80}")
            if not _is_plain(value):
                raise ValueError(f"layer {layer_id}: block attribute {key!r} is not a plain value")
    return raw


def block_info(block: nn.Module, key: str) -> dict[str, Any]:
    """The ``block`` part of a moved layer's manifest: what the
    target needs besides the tensors to rebuild it."""
    return {"kind": block_kind(block), "key": key, "attrs": block_attrs(block)}


def validate_block_info(raw: Any, layer_id: int) -> dict[str, Any]:
    """Check the ``block`` part of a moved layer's manifest (kind, key, plain attributes)."""
    if not isinstance(raw, dict) or set(raw) != {"kind", "key", "attrs"}:
        raise ValueError(f"layer {layer_id}: the block description must have kind, key and attrs")
    if not isinstance(raw["kind"], str) or not 0 < len(raw["kind"]) <= 64:
        raise ValueError(f"layer {layer_id}: bad block kind {raw['kind']!r:.80}")
    if raw["key"] is not None and (not isinstance(raw["key"], str) or not 0 < len(raw["key"]) <= _MAX_TEXT
                                   or "." in raw["key"]):
        raise ValueError(f"layer {layer_id}: bad block key {raw['key']!r:.80}")
    validate_attrs(raw["attrs"], layer_id)
    return raw


def set_block_attrs(block: nn.Module, attrs: Mapping[str, Mapping[str, Any]], layer_id: int) -> None:
    """Give ``block`` (a clone) the moved block's plain attributes; both must have the same ones."""
    mine = block_attrs(block)
    if {k: set(v) for k, v in mine.items()} != {k: set(v) for k, v in attrs.items()}:
        raise ValueError(f"layer {layer_id}: the block here has plain attributes {_names(mine)}, the moved "
                         f"one {_names(attrs)}: they are not the same kind of block")
    for sub, values in attrs.items():
        module = block.get_submodule(sub)
        for key, value in values.items():
            old = getattr(module, key)
            setattr(module, key, tuple(value) if isinstance(old, tuple) and isinstance(value, list)
                    else value)


def _names(attrs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    return sorted(f"{sub}.{k}" if sub else k for sub, values in attrs.items() for k in values)[:6]


def _extent(t: torch.Tensor) -> int:
    """Elements of storage ``t`` reaches past its offset."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def _empty_alike(tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Uninitialised tensors like ``tensors`` (by id), sharing storage where the originals share it.

    A storage shared by several of them gets one new storage covering only the bytes they
    reach (a block's views into a larger flat buffer do not copy that buffer's size).
    """
    by_storage: dict[tuple[str, int], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() and t.device.type != "meta":
            by_storage.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(t)
    out = {id(t): torch.empty_like(t) for t in tensors}
    for group in by_storage.values():
        if len({id(t) for t in group}) < 2:
            continue
        start = min(t.storage_offset() * t.element_size() for t in group)
        if any((t.storage_offset() * t.element_size() - start) % t.element_size() for t in group):
            continue  # views of one storage at offsets no single layout can express: separate copies
        end = max((t.storage_offset() + _extent(t)) * t.element_size() for t in group)
        storage = torch.UntypedStorage(end - start, device=group[0].device)
        for t in group:
            offset = (t.storage_offset() * t.element_size() - start) // t.element_size()
            out[id(t)] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, offset, t.shape,
                                                                             t.stride())
    return out


def clone_block(donor: nn.Module, placeholders: Mapping[int, nn.Parameter] | None = None) -> nn.Module:
    """A structural copy of ``donor`` with uninitialised tensors and no hooks, for a moved block's state.

    ``copy.deepcopy`` with a memo that maps every parameter and buffer to an empty tensor
    of its shape (no data copied; tensors that share storage in the donor, a buffer that is a
    view of another, share storage in the clone alike) and every hook table to an empty one (vpipe's and the
    user's hooks stay on the donor); a forward that vpipe routed for recompute is dropped. A tensor-parallel
    block's DTensors become empty DTensors of the same mesh and placements, and the clone keeps the hooks
    with which the parallel styles redistribute its inputs and outputs (:mod:`vpipe.stage.tensor_parallel`). A
    ``torch.compile`` wrapper is rebuilt around the clone of the module it compiles, with the
    donor's dynamo context: the same backend, mode, options, ``fullgraph`` and ``dynamic``; a
    module compiled in place is compiled as its donor counterpart is (:mod:`.compiled`). A block
    ``fully_shard``-ed by itself is cloned plain and sharded with the donor's mesh and options
    (:mod:`.fsdp`); a wrapper ``fully_shard``-ed over the module it compiles is rebuilt plain around a
    plain clone (``placeholders``: the parameters to put in place of the donor's) and sharded alike.
    """
    inner = compiled_inner(donor)
    if inner is not None and is_fully_sharded(donor):  # compiled, then sharded: the same order for the clone
        plain = clone_block(inner, unsharded_placeholders(donor))
        return shard_like(donor, unsharded_class(donor)(plain, donor.dynamo_ctx))
    if inner is not None:  # compile the clone of what the donor compiles, the same way (same dynamo context)
        return type(donor)(clone_block(inner, placeholders), donor.dynamo_ctx)
    memo: dict[int, Any] = dict(placeholders or {})
    for module in donor.modules():
        kept = parallel_hook_ids(module)  # how a tensor-parallel module redistributes: the clone must too
        for table in call_hook_tables(module):  # other hooks (vpipe's, the user's) stay with the donor
            memo[id(table)] = keep_parallel_hooks(table, kept)
        routed = module.__dict__.get("forward")
        if routed is not None and is_routed_forward(routed):
            memo[id(routed)] = None
    for compiled in compiled_forwards(donor):  # bound to the donor: the clone gets its own (compile_like)
        memo[id(compiled)] = None
    if is_fully_sharded(donor):  # FSDP refuses deepcopy: a plain copy, sharded as the donor is
        clone = clone_sharded(donor, memo)
        _drop_routed(clone)
        return clone
    tensors = [t for t in (*donor.parameters(), *donor.buffers()) if id(t) not in memo]
    empty = _empty_alike([t for t in tensors if not isinstance(t, DTensor)])
    empty.update({id(t): empty_dtensor(t) for t in tensors if isinstance(t, DTensor)})
    for p in donor.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(empty[id(p)], requires_grad=p.requires_grad)
    for b in donor.buffers():
        memo[id(b)] = empty[id(b)]
    clone = copy.deepcopy(donor, memo)
    _drop_routed(clone)
    compile_like(donor, clone)
    return clone


def _drop_routed(clone: nn.Module) -> None:
    """Remove the forwards the memo turned into None (vpipe's recompute routing stays with the donor)."""
    for module in clone.modules():
        if "forward" in module.__dict__ and module.__dict__["forward"] is None:
            del module.__dict__["forward"]
