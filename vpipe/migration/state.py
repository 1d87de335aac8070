"""A layer's complete training state, packed for the wire and unpacked on another stage.

What moves with a layer: its parameters, its buffers, and its optimizer state (e.g. Adam's
moments and step counts), plus the index of the optimizer param group each parameter sits
in. The state splits into a *manifest* of plain values (msgpack-able, sent on the control
plane, validated on arrival) and one flat byte tensor with every tensor's bytes (sent over
``torch.distributed``), so a move is a single transfer whatever the layer holds.

Optimizers are edited in place: parameters are appended to / removed from the existing
``param_groups`` lists and ``optimizer.state``, so learning-rate schedulers (which hold the
optimizer, not the lists) keep working.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vpipe.migration.blocks import validate_block_info

__all__ = ["LayerState", "pack_layer", "unpack_layer", "attach_to_optimizer", "detach_from_optimizer",
           "validate_manifest"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"cannot migrate tensors of dtype {dtype}")
    return name


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
    return {"kind": kind, "name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype),
            "nbytes": t.numel() * t.element_size(), **extra}


def _param_group_index(optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    if optimizer is None:
        return {}
    return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


def pack_layer(layer_id: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
               spec: Any = None) -> LayerState:
    """Everything needed to continue training ``module`` elsewhere, bit for bit."""
    groups = _param_group_index(optimizer)
    entries: list[dict[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for name, p in module.named_parameters():
        entries.append(_entry("param", name, p, requires_grad=p.requires_grad, group=groups.get(id(p))))
        tensors.append(p.detach())
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                entries.append(_entry("optim", name, value, key=key, with_param=value.device == p.device))
                tensors.append(value)
            else:
                entries.append({"kind": "optim_value", "name": name, "key": key, "value": value, "nbytes": 0})
    for name, b in module.named_buffers():
        entries.append(_entry("buffer", name, b))
        tensors.append(b)
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel() > 0]
    payload = (torch.cat([f.cpu() if f.device.type != "cpu" else f for f in flat]) if flat
               else torch.empty(0, dtype=torch.uint8))
    manifest = {"layer": layer_id, "spec": spec, "entries": entries}
    return LayerState(layer_id, manifest, payload)


def validate_manifest(manifest: Any) -> dict[str, Any]:
    """Check a manifest that came from another rank before acting on it."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), list):
        raise ValueError("layer manifest must be a map with an 'entries' list")
    layer = manifest.get("layer")
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise ValueError(f"layer manifest has a bad layer id {layer!r}")
    if manifest.get("block") is not None:
        validate_block_info(manifest["block"], layer)
    for i, e in enumerate(manifest["entries"]):
        if not isinstance(e, dict) or e.get("kind") not in ("param", "optim", "optim_value", "buffer"):
            raise ValueError(f"layer {layer}: manifest entry #{i} has an unknown kind")
        if not isinstance(e.get("name"), str):
            raise ValueError(f"layer {layer}: manifest entry #{i} has no name")
        if e["kind"] == "optim_value":
            continue
        shape, dtype, nbytes = e.get("shape"), e.get("dtype"), e.get("nbytes")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"layer {layer}: entry {e['name']!r} has a bad shape {shape!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"layer {layer}: entry {e['name']!r} has an unknown dtype {dtype!r}")
        numel = 1
        for d in shape:
            numel *= d
        if nbytes != numel * torch.empty((), dtype=_DTYPES[dtype]).element_size():
            raise ValueError(f"layer {layer}: entry {e['name']!r} claims {nbytes!r} bytes for shape {shape}")
    return manifest


def payload_bytes(manifest: dict[str, Any]) -> int:
    return sum(e.get("nbytes", 0) for e in manifest["entries"])


def unpack_layer(state: LayerState, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load ``state`` into a freshly built ``module`` and register it with ``optimizer``."""
    manifest = validate_manifest(state.manifest)
    if state.nbytes != payload_bytes(manifest):
        raise ValueError(f"layer {state.layer_id}: payload has {state.nbytes} bytes, "
                         f"manifest says {payload_bytes(manifest)}")
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    offset = 0
    optim_state: dict[str, dict[str, Any]] = {}
    groups: dict[str, int | None] = {}
    for e in manifest["entries"]:
        if e["kind"] == "optim_value":
            optim_state.setdefault(e["name"], {})[e["key"]] = e["value"]
            continue
        raw = state.payload[offset:offset + e["nbytes"]]
        offset += e["nbytes"]
        dtype = _DTYPES[e["dtype"]]
        value = raw.view(dtype).reshape(e["shape"]) if e["nbytes"] else torch.empty(e["shape"], dtype=dtype)
        if e["kind"] == "param":
            target = _lookup(params, e["name"], state.layer_id, "parameter")
            _load(target, value, e, state.layer_id)
            target.requires_grad_(bool(e.get("requires_grad", True)))
            groups[e["name"]] = e.get("group")
        elif e["kind"] == "buffer":
            _load(_lookup(buffers, e["name"], state.layer_id, "buffer"), value, e, state.layer_id)
        else:
            owner = _lookup(params, e["name"], state.layer_id, "parameter")
            device = owner.device if e.get("with_param", True) else torch.device("cpu")
            optim_state.setdefault(e["name"], {})[e["key"]] = value.to(device).clone()
    missing = sorted(set(params) - set(groups))
    if missing:
        raise ValueError(f"layer {state.layer_id}: the manifest has no values for parameters {missing}")
    if optimizer is not None:
        for name, p in params.items():
            g = groups[name]
            if g is None:
                continue
            if not 0 <= g < len(optimizer.param_groups):
                raise ValueError(f"layer {state.layer_id}: parameter {name} belongs to optimizer param group {g}, "
                                 f"this stage's optimizer has {len(optimizer.param_groups)}")
            optimizer.param_groups[g]["params"].append(p)
            if name in optim_state:
                optimizer.state[p] = optim_state[name]


def _lookup(table: Mapping[str, torch.Tensor], name: str, layer_id: int, what: str) -> torch.Tensor:
    if name not in table:
        raise ValueError(f"layer {layer_id}: the built module has no {what} {name!r}")
    return table[name]


def _load(target: torch.Tensor, value: torch.Tensor, entry: dict[str, Any], layer_id: int) -> None:
    if list(target.shape) != entry["shape"] or target.dtype != _DTYPES[entry["dtype"]]:
        raise ValueError(f"layer {layer_id}: {entry['name']} is {tuple(target.shape)} {target.dtype} here "
                         f"but {tuple(entry['shape'])} {entry['dtype']} on the sender")
    with torch.no_grad():
        target.copy_(value)


def detach_from_optimizer(optimizer: torch.optim.Optimizer | None, params: Iterable[torch.Tensor]) -> None:
    """Remove parameters (and their state) from ``optimizer``'s groups, in place."""
    if optimizer is None:
        return
    ids = {id(p) for p in params}
    for group in optimizer.param_groups:
        group["params"][:] = [p for p in group["params"] if id(p) not in ids]
    for p in [p for p in optimizer.state if id(p) in ids]:
        del optimizer.state[p]


def attach_to_optimizer(optimizer: torch.optim.Optimizer | None, params: Iterable[torch.Tensor],
                        group: int = 0) -> None:
    """Add new parameters to ``optimizer``'s param group ``group``, in place (their state starts empty)."""
    if optimizer is not None:
        optimizer.param_groups[group]["params"].extend(params)
