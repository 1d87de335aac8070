"""A layer's complete training state, packed for the wire and unpacked on another stage.

What moves with a layer: its parameters, their gradients where a step left some pending (a trainer
that accumulates gradients over several ``schedule.step()`` calls before its ``optimizer.step()``),
its buffers, its optimizer state (e.g. Adam's moments and step counts), the settings of the param
group each parameter sits in, which decide the group it joins on arrival (:mod:`.groups`), and the
weight averages carried beside its stage (:mod:`.carried`). The state splits into a *manifest* of
plain values (msgpack-able, sent on the control plane, validated on arrival) and one flat byte
tensor with every tensor's bytes (sent over ``torch.distributed``), so a move is a single transfer.

The wire format assumes no alignment: each tensor's bytes follow the previous one's (a 0-d
int64 ``step`` after a 9-byte run of bools is fine), and the receiver copies them into a fresh
tensor of the entry's dtype (:func:`decode_tensor`) instead of viewing the byte buffer as a
wider dtype. An optimizer state tensor that is the same object as an earlier one (two keys, two
parameters) is sent once and arrives as one object again; a non-contiguous one keeps its strides.

A parameter sharded by FSDP2 (a ``DTensor``) travels as this rank's local shard, and so does
its optimizer state (Adam's moments are DTensors too); the entry is marked ``shard`` and the
receiver, whose block is sharded alike, loads the shard and wraps the state back into a
DTensor like its parameter.

Optimizers are edited in place: parameters are appended to / removed from the existing
``param_groups`` lists and ``optimizer.state``, so learning-rate schedulers (which hold the
optimizer, not the lists) keep working.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vpipe.migration.cloning import validate_block_info
from vpipe.migration.loading import (
    DTYPES,
    dtype_name,
    like_owner,
    load_buffer,
    load_grad,
    load_tensor,
    lookup,
)
from vpipe.stage.groups import group_settings, matching_group
from vpipe.stage.optimizers import group_kinds

__all__ = ["LayerState", "LoadedLayer", "pack_layer", "load_layer", "register_layer", "unpack_layer",
           "decode_tensor", "attach_to_optimizer", "detach_from_optimizer", "validate_manifest"]

_PLAIN = (bool, int, float, str, type(None))


@dataclass
class LayerState:
    """``manifest`` travels on the control plane, ``payload`` (uint8) over torch.distributed."""

    layer_id: int
    manifest: dict[str, Any]
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.payload.numel())


def _entry(kind: str, name: str, t: torch.Tensor, **extra: Any) -> dict[str, Any]:
    """A tensor's manifest entry; ``t`` is what travels (a sharded tensor's local shard, marked ``shard``)."""
    if isinstance(t, DTensor):
        raise TypeError(f"{name}: pack the local shard of a sharded tensor, not the DTensor")
    return {"kind": kind, "name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype),
            "nbytes": t.numel() * t.element_size(), **extra}


def _local(t: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """What of ``t`` travels: this rank's shard of a DTensor (FSDP2), else ``t``; and the entry's mark for it.

    A dp rank sends its shards to the rank with the same dp coordinate on the neighbouring
    stage, whose block, sharded alike, holds the same shard of every tensor.
    """
    return (t.to_local(), {"shard": True}) if isinstance(t, DTensor) else (t, {})


def _dense_strides(shape: list[int], stride: list[int]) -> bool:
    """Whether ``stride`` lays out ``shape`` densely with no element
    twice (a permutation of a contiguous layout)."""
    expected = 1
    for st, size in sorted((st, size) for st, size in zip(stride, shape) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def _layout(t: torch.Tensor) -> dict[str, Any]:
    """The strides of a dense, non-contiguous optimizer state tensor
    (a transposed moment), so it arrives alike."""
    shape, stride = list(t.shape), list(t.stride())
    if stride == list(torch.empty(shape, device="meta").stride()) or not _dense_strides(shape, stride):
        return {}
    return {"stride": list(t.stride())}


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)) and depth < 4:
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict) and depth < 4:
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _param_group_index(optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    if optimizer is None:
        return {}
    return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


def _grad_entry(name: str, p: torch.Tensor, entries: list[dict[str, Any]],
                tensors: list[torch.Tensor]) -> None:
    """A gradient the trainer has not stepped on yet travels with its parameter (as its shard, sharded)."""
    if p.grad is None:
        return
    local, mark = _local(p.grad.detach())
    entries.append(_entry("grad", name, local, key="grad", **mark))
    tensors.append(local)


def _optimizer_entries(name: str, p: torch.Tensor, optimizer: torch.optim.Optimizer | None,
                       entries: list[dict[str, Any]], tensors: list[torch.Tensor],
                       sent: dict[int, int]) -> None:
    """Append the optimizer state of parameter ``name``: tensors (each object once), and plain values."""
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ValueError(f"cannot migrate optimizer state key {key!r} of {name}: keys must be strings")
        if isinstance(value, torch.Tensor):
            if id(value) in sent:  # the same tensor object again: it arrives as that object again
                entries.append({"kind": "optim_alias", "name": name, "key": key, "same_as": sent[id(value)]})
                continue
            sent[id(value)] = len(entries)
            local, mark = _local(value)
            entries.append(_entry("optim", name, local, key=key, with_param=value.device == p.device,
                                  **_layout(local), **mark))
            tensors.append(local)
        elif _plain(value):
            entries.append({"kind": "optim_value", "name": name, "key": key, "value": value, "nbytes": 0})
        else:
            raise ValueError(f"cannot migrate optimizer state {key!r} of {name}: a {type(value).__name__} is "
                             "neither a tensor nor a plain value")


def pack_layer(layer_id: int, module: nn.Module, optimizer: torch.optim.Optimizer | None, spec: Any = None,
               carried: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> LayerState:
    """Everything needed to continue training ``module`` elsewhere, bit for bit; ``carried``: its averages
    beside the stage, by their place in ``carry=`` (:mod:`.carried`)."""
    groups = _param_group_index(optimizer)
    entries: list[dict[str, Any]] = []
    tensors: list[torch.Tensor] = []
    sent: dict[int, int] = {}
    settings: dict[str, dict[str, Any]] = {}
    kinds = group_kinds(optimizer) if optimizer is not None else []
    for name, p in module.named_parameters():
        local, mark = _local(p.detach())
        g = groups.get(id(p))
        entries.append(_entry("param", name, local, requires_grad=p.requires_grad, group=g, **mark))
        tensors.append(local)
        _grad_entry(name, p, entries, tensors)
        _optimizer_entries(name, p, optimizer, entries, tensors, sent)
        if g is not None and optimizer is not None:
            settings.setdefault(str(g), group_settings(optimizer.param_groups[g], kinds[g]))
    for name, b in module.named_buffers():
        local, mark = _local(b)
        entries.append(_entry("buffer", name, local, **mark))
        tensors.append(local)
    for index, averaged in (carried or {}).items():
        entries += [_entry("carried", name, t.detach(), carry=index) for name, t in averaged.items()]
        tensors += [t.detach() for t in averaged.values()]
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel() > 0]
    payload = (torch.cat([f.cpu() if f.device.type != "cpu" else f for f in flat]) if flat
               else torch.empty(0, dtype=torch.uint8))
    manifest = {"layer": layer_id, "spec": spec, "entries": entries, "groups": settings}
    return LayerState(layer_id, manifest, payload)


_KINDS = ("param", "grad", "optim", "optim_value", "optim_alias", "buffer", "carried")


def validate_manifest(manifest: Any) -> dict[str, Any]:
    """Check a manifest that came from another rank before acting on it."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), list):
        raise ValueError("layer manifest must be a map with an 'entries' list")
    layer = manifest.get("layer")
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise ValueError(f"layer manifest has a bad layer id {layer!r}")
    if manifest.get("block") is not None:
        validate_block_info(manifest["block"], layer)
    groups = manifest.get("groups", {})
    if not isinstance(groups, dict) or not all(isinstance(k, str) and k.isdigit() and isinstance(v, dict)
                                               for k, v in groups.items()):
        raise ValueError(f"layer {layer} manifest has bad param group settings")
    entries = manifest["entries"]
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or e.get("kind") not in _KINDS:
            raise ValueError(f"layer {layer}: manifest entry #{i} has an unknown kind")
        if not isinstance(e.get("name"), str):
            raise ValueError(f"layer {layer}: manifest entry #{i} has no name")
        if e["kind"] in ("optim_value", "optim_alias") and not isinstance(e.get("key"), str):
            raise ValueError(f"layer {layer}: manifest entry #{i} has no optimizer state key")
        if e["kind"] == "optim_alias":
            same = e.get("same_as")
            if not isinstance(same, int) or isinstance(same, bool) or not 0 <= same < i \
                    or entries[same].get("kind") != "optim":
                raise ValueError(f"layer {layer}: entry {e['name']!r} aliases {same!r}, not "
                                 "an earlier optimizer state tensor")
            continue
        if e["kind"] == "optim_value":
            continue
        if e["kind"] == "carried" and not (type(e.get("carry")) is int and 0 <= e["carry"] < 64):
            raise ValueError(f"layer {layer}: entry {e['name']!r} is carried by a bad "
                             f"average {e.get('carry')!r}")
        _validate_tensor_entry(e, layer)
    return manifest


def _validate_tensor_entry(e: dict[str, Any], layer: int) -> None:
    shape, dtype, nbytes = e.get("shape"), e.get("dtype"), e.get("nbytes")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"layer {layer}: entry {e['name']!r} has a bad shape {shape!r}")
    if dtype not in DTYPES:
        raise ValueError(f"layer {layer}: entry {e['name']!r} has an unknown dtype {dtype!r}")
    numel = 1
    for d in shape:
        numel *= d
    if nbytes != numel * torch.empty((), dtype=DTYPES[dtype]).element_size():
        raise ValueError(f"layer {layer}: entry {e['name']!r} claims {nbytes!r} bytes for shape {shape}")
    if not isinstance(e.get("shard", False), bool):
        raise ValueError(f"layer {layer}: entry {e['name']!r} has a bad shard mark {e['shard']!r}")
    stride = e.get("stride")
    if stride is not None and (not isinstance(stride, list) or len(stride) != len(shape)
                               or not all(isinstance(d, int) and d >= 0 for d in stride)
                               or not _dense_strides(shape, stride)):
        raise ValueError(f"layer {layer}: entry {e['name']!r} has bad strides {stride!r} for shape {shape}")


def payload_bytes(manifest: dict[str, Any]) -> int:
    return sum(e.get("nbytes", 0) for e in manifest["entries"])


def decode_tensor(raw: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    """A fresh tensor holding ``raw``'s bytes as ``entry`` describes (validated): no alignment assumed.

    The byte slice may start at any offset of the received buffer, so it is copied into a
    new tensor of the entry's dtype instead of being viewed as that dtype.
    """
    dtype = DTYPES[entry["dtype"]]
    value = torch.empty(entry["shape"], dtype=dtype, device=raw.device)
    if entry["nbytes"]:
        value.reshape(-1).view(torch.uint8).copy_(raw)
    stride = entry.get("stride")
    if stride is not None:
        value = torch.empty_strided(entry["shape"], stride, dtype=dtype, device=raw.device).copy_(value)
    return value


@dataclass
class LoadedLayer:
    """A layer whose tensors are in its new module; its parameters
    join the optimizer when the move commits."""

    layer_id: int
    params: Mapping[str, torch.Tensor]
    groups: dict[str, int | None]
    optim_state: dict[str, dict[str, Any]]
    carried: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # average -> name -> tensor


def load_layer(state: LayerState, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> LoadedLayer:
    """Check ``state`` against ``module`` and ``optimizer`` and copy
    its tensors into ``module`` (a fresh block).

    The optimizer is only read here (which of its param groups each parameter joins), so a
    state that fails any check leaves the stage as it was; :func:`register_layer` then edits
    the optimizer. Gradients the sender had pending are set on the fresh block's parameters.
    """
    manifest = validate_manifest(state.manifest)
    if state.nbytes != payload_bytes(manifest):
        raise ValueError(f"layer {state.layer_id}: payload has {state.nbytes} bytes, "
                         f"manifest says {payload_bytes(manifest)}")
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    offset = 0
    optim_state: dict[str, dict[str, Any]] = {}
    decoded: dict[int, torch.Tensor] = {}  # entry index -> optimizer state tensor (for aliases)
    groups: dict[str, int | None] = {}
    carried: dict[int, dict[str, torch.Tensor]] = {}
    for i, e in enumerate(manifest["entries"]):
        if e["kind"] == "optim_value":
            optim_state.setdefault(e["name"], {})[e["key"]] = e["value"]
            continue
        if e["kind"] == "optim_alias":
            optim_state.setdefault(e["name"], {})[e["key"]] = decoded[e["same_as"]]
            continue
        value = decode_tensor(state.payload[offset:offset + e["nbytes"]], e)
        offset += e["nbytes"]
        if e["kind"] == "param":
            target = lookup(params, e["name"], state.layer_id, "parameter")
            load_tensor(target, value, e, state.layer_id)
            target.requires_grad_(bool(e.get("requires_grad", True)))
            groups[e["name"]] = e.get("group")
        elif e["kind"] == "buffer":
            load_buffer(module, lookup(buffers, e["name"], state.layer_id, "buffer"), value, e,
                        state.layer_id)
        elif e["kind"] == "grad":
            load_grad(lookup(params, e["name"], state.layer_id, "parameter"), value, e, state.layer_id)
        elif e["kind"] == "carried":
            carried.setdefault(e["carry"], {})[e["name"]] = value
        else:
            owner = lookup(params, e["name"], state.layer_id, "parameter")
            device = owner.device if e.get("with_param", True) else torch.device("cpu")
            decoded[i] = optim_state.setdefault(e["name"], {})[e["key"]] = like_owner(value.to(device), owner,
                                                                                      e,
                                                                                      state.layer_id)
    missing = sorted(set(params) - set(groups))
    if missing:
        raise ValueError(f"layer {state.layer_id}: the manifest has no values for parameters {missing}")
    if optimizer is not None:
        groups = {name: _group_here(g, manifest, optimizer, f"layer {state.layer_id}'s {name}")
                  for name, g in groups.items()}
    return LoadedLayer(state.layer_id, params, groups, optim_state, carried)


def _group_here(g: int | None, manifest: dict[str, Any], optimizer: torch.optim.Optimizer,
                what: str) -> int | None:
    """The index of the param group a parameter that sat in group ``g`` on its stage joins here: the group
    with the same settings (a manifest without settings, from an older sender, keeps the index)."""
    if g is None:
        return None
    settings = manifest.get("groups", {}).get(str(g))
    if settings is not None:
        return matching_group(settings, optimizer.param_groups, preferred=g, what=what,
                              kinds=group_kinds(optimizer))
    count = len(optimizer.param_groups)
    if not (isinstance(g, int) and 0 <= g < count):
        raise ValueError(f"{what} belongs to optimizer param group {g}, this stage's optimizer has {count}")
    return g


def register_layer(loaded: LoadedLayer, optimizer: torch.optim.Optimizer | None) -> None:
    """Put a loaded layer's parameters into their optimizer param groups, with their state."""
    if optimizer is None:
        return
    for name, p in loaded.params.items():
        g = loaded.groups[name]
        if g is None:
            continue
        optimizer.param_groups[g]["params"].append(p)
        if name in loaded.optim_state:
            optimizer.state[p] = loaded.optim_state[name]


def unpack_layer(state: LayerState, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load ``state`` into a freshly built ``module`` and register it with ``optimizer``."""
    register_layer(load_layer(state, module, optimizer), optimizer)


def detach_from_optimizer(optimizer: torch.optim.Optimizer | None, params: Iterable[torch.Tensor]) -> None:
    """Remove parameters (and their state) from ``optimizer``'s groups, in place."""
    if optimizer is None:
        return
    ids = {id(p) for p in params}
    # first: several optimizers' state is found by group
    for p in [p for p in optimizer.state if id(p) in ids]:
        del optimizer.state[p]
    for group in optimizer.param_groups:
        group["params"][:] = [p for p in group["params"] if id(p) not in ids]


def attach_to_optimizer(optimizer: torch.optim.Optimizer | None, params: Iterable[torch.Tensor],
                        group: int = 0) -> None:
    """Add new parameters to ``optimizer``'s param group ``group``, in place (their state starts empty)."""
    if optimizer is not None:
        optimizer.param_groups[group]["params"].extend(params)
