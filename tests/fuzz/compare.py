"""Naming every tensor of a copy by global layer id, snapshotting it,
and judging two copies against each other.

A block's tensors are named ``L<layer_id>.<name in the block>`` wherever the block runs, the
stage's own modules (embeddings, head) ``s.<name>``; the optimizer's state ``opt:<tensor>:<key>``
and the hyperparameters of the group a parameter is in ``group:<tensor>``. Under FSDP2 every
name gets its data-parallel replica's prefix (buffers differ between replicas).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch

from fuzz.draws import Draw
from fuzz.models import container
from fuzz.trainer import Copy

# for draws whose arithmetic depends on the split (global clipping) only: a difference within
# RTOL of the tensor's largest magnitude. One rounding of the clip factor grows over a few steps
# (RMSprop and Adam divide by small second moments, bf16 rounds again); a lost gradient or a
# wrong learning rate moves parameters by a whole update
RTOL, ATOL = 5e-3, 1e-6


def _named(d: Draw, c: Copy,
           modules: list[torch.nn.Module] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of this rank's stages (or of ``modules`` shaped like them: an EMA's
    copies) under its global name (shared ones under each name)."""
    # 4 ranks: each data-parallel replica's names apart, or each tp rank's (its shards, its plain tensors)
    prefix = f"r{c.replica}/" if d.ranks == 4 else ""
    if c.tp_mesh is not None:
        prefix = f"t{c.tp_mesh.get_local_rank()}/"
    for module in c.modules if modules is None else modules:
        seen: set[int] = set()
        for i, block in enumerate(container(d, module).children()):
            # a module that is not one of the model's blocks (vpipe put it there) gets a name of its own
            lid = getattr(block, "layer_id", f"?{type(block).__name__}@{i}")
            for n, t in chain(block.named_parameters(remove_duplicate=False),
                              block.named_buffers(remove_duplicate=False)):
                seen.add(id(t))
                yield f"{prefix}L{lid}.{n}", t
        for n, t in chain(module.named_parameters(), module.named_buffers()):
            if id(t) not in seen:
                yield f"{prefix}s.{n}", t


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def fingerprint(d: Draw, c: Copy) -> dict[str, tuple[int, float]]:
    """Each parameter's (crc32 of its bytes, float64 sum) on this rank after a step (a shard under FSDP2:
    keyed by replica, so the copies' shards meet under one key)."""
    out = {}
    for name, t in _named(d, c):
        if isinstance(t, torch.nn.Parameter):
            local = _local(t).detach().contiguous()
            out[name] = (zlib.crc32(local.reshape(-1).view(torch.uint8).numpy().tobytes()),
                         float(local.double().sum()))
    return out


def snapshot(d: Draw, c: Copy) -> dict[str, Any]:
    """This rank's part of the copy's final state: parameters, buffers, optimizer state, group hyperparameters
    (collective under FSDP2: the replicas of a stage hold the same blocks in the same order)."""
    out: dict[str, Any] = {}
    names: dict[int, str] = {}
    for name, t in _named(d, c):
        names.setdefault(id(t), name)
        out[name] = _full(t)
    for name, t in _named(d, c, [average.module for average in c.averages]):
        out[f"ema:{name}"] = _full(t)
    for o in c.optimizers:
        for g in o.param_groups:
            hyper = json.dumps({k: v for k, v in g.items() if k != "params"}, sort_keys=True, default=str)
            for p in g["params"]:
                name = names.get(id(p), f"?param{tuple(p.shape)}")  # a parameter no stage module holds
                out[f"group:{name}"] = hyper
                for key, value in o.state.get(p, {}).items():
                    out[f"opt:{name}:{key}"] = _full(value)
    return out


def merge(parts: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The ranks' parts as one map, and the names more than one rank holds (a block on two stages)."""
    merged: dict[str, Any] = {}
    twice = []
    for part in parts:
        for k, v in part.items():
            if k in merged:
                twice.append(k)
            merged[k] = v
    return merged, sorted(set(twice))


def _diff(a: Any, b: Any) -> tuple[bool, float]:
    """(close, max abs difference) of two unequal values."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, math.inf
        if not a.is_floating_point():
            return False, float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        da, db = a.double(), b.double()
        worst = float((da - db).abs().max()) if a.numel() else 0.0
        scale = max(float(da.abs().max()), float(db.abs().max())) if a.numel() else 0.0
        return worst <= RTOL * scale + ATOL, worst
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= RTOL * max(abs(a), abs(b)) + ATOL, abs(a - b)
    return False, math.inf


def _equal(a: Any, b: Any) -> bool:
    """Bitwise: a NaN equals the same NaN (a draw whose trainer blows up does so in both copies alike)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(_bits(a), _bits(b)))
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool or t.numel() == 0:
        return t
    return t.contiguous().reshape(-1).view(torch.uint8)


def compare_maps(plain: dict[str, Any], moved: dict[str, Any]) -> dict[str, Any]:
    """Which names differ (bitwise), whether all of them are close, and the largest difference."""
    differing, close, worst, amounts = [], True, 0.0, []
    for key in sorted(set(plain) | set(moved)):
        if key not in plain or key not in moved:
            differing.append(key)
            close, worst = False, math.inf
            continue
        if _equal(plain[key], moved[key]):
            continue
        differing.append(key)
        ok, amount = _diff(plain[key], moved[key])
        close, worst = close and ok, max(worst, amount)
        scale = float(plain[key].abs().max()) if isinstance(plain[key],
                                                            torch.Tensor) and plain[key].numel() else 0.0
        amounts.append((amount, key, scale))
    largest = [f"{key}: {amount:.3g} (of {scale:.3g})"
               for amount, key, scale in sorted(amounts, reverse=True)[:5]]
    return {"differing": differing, "close": close, "max_abs_diff": worst, "largest": largest}


def compare_losses(plain: dict[int, list], moved: dict[int, list]) -> dict[str, Any]:
    """Per replica, per step, per micro-batch losses: the first step
    that differs (bitwise), and whether close."""
    first, close, worst = None, True, 0.0
    for replica in sorted(set(plain) | set(moved)):
        a, b = plain.get(replica, []), moved.get(replica, [])
        if len(a) != len(b):
            first, close, worst = 0, False, math.inf
            continue
        for step, (la, lb) in enumerate(zip(a, b)):
            if len(la) == len(lb) and all(_equal(float(x), float(y)) for x, y in zip(la, lb)):
                continue
            first = step if first is None else min(first, step)
            for x, y in zip(la, lb):
                ok, amount = _diff(float(x), float(y)) if x != y else (True, 0.0)
                close, worst = close and ok and len(la) == len(lb), max(worst, amount)
    return {"first_step": first, "close": close, "max_abs_diff": worst}


def first_state_step(plain: list[dict[str, tuple[int, float]]], moved: list[dict[str, tuple[int, float]]],
                     rounding: bool) -> tuple[int | None, list[str]]:
    """The first step after which some parameter differs (bitwise, or beyond rounding for a
    rounding draw), and the parameters that differ then."""
    for step, (a, b) in enumerate(zip(plain, moved)):
        keys = sorted(set(a) ^ set(b))
        for key in sorted(set(a) & set(b)):
            if a[key][0] != b[key][0] and (not rounding
                                           or not math.isclose(a[key][1], b[key][1], rel_tol=RTOL,
                                                                             abs_tol=1e-3)):
                keys.append(key)
        if keys:
            return step, keys
    return None, []


def family(key: str) -> str:
    """What kind of state a differing name is: a parameter group's hyperparameters, optimizer state, a buffer
    (by its name) or a parameter."""
    if key.startswith("group:"):
        return "param_group"
    if key.startswith("opt:"):
        return "optimizer_state"
    last = key.rsplit(".", 1)[-1]
    if last in ("running_mean", "running_var", "num_batches_tracked", "calls", "scale", "tokens_per_expert"):
        return "buffer"
    return "parameter"
