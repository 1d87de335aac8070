"""Writing a checkpoint: every rank its shard, rank 0 the manifest that seals them, then pruning.

A shard holds one rank's parameters and buffers, its optimizer state and param groups by
parameter name, the learning-rate scheduler's state and the rank's RNG state. The ranks
report their shards' entries through the run's store; rank 0 checks that the shards hold
exactly the placed layers, writes the manifest last and keeps the newest complete
checkpoints.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vpipe.checkpoint.files import atomic_write
from vpipe.checkpoint.layout import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    ShardInfo,
    check_vpipe_state,
    checkpoint_dir,
    manifest_digest,
    step_dirs,
)

log = logging.getLogger("vpipe.checkpoint")

__all__ = ["optimizer_state", "optimizer_groups", "save_shard", "write_manifest", "save_checkpoint"]

_SHARD_KEY = "vpipe/checkpoint/{}/{}"
_SCALARS = (bool, int, float, type(None))


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, dict[str, Any]]:
    """The optimizer state of ``module``'s parameters by parameter name: tensors and plain numbers."""
    if optimizer is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, p in module.named_parameters():
        state = optimizer.state.get(p)
        if state:
            out[name] = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in state.items() if isinstance(v, torch.Tensor) or isinstance(v, _SCALARS)}
    return out


def optimizer_groups(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    """The optimizer's param groups with parameters by name: hyperparameters a resume must not lose."""
    if optimizer is None:
        return []
    names = {id(p): name for name, p in module.named_parameters()}
    return [{**{k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in group.items() if k != "params"},
             "params": [names[id(p)] for p in group["params"] if id(p) in names]}
            for group in optimizer.param_groups]


def save_shard(step_dir: str | os.PathLike[str], rank: int, module: nn.Module,
               optimizer: torch.optim.Optimizer | None, policies: Mapping[int, Any] | None = None,
               scheduler: Any = None) -> ShardInfo:
    """Write this rank's parameters, buffers, optimizer state and groups, scheduler and RNG state atomically;
    return its manifest entry."""
    step_dir = Path(step_dir)
    step_dir.mkdir(parents=True, exist_ok=True)
    state = {"params": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
             "optimizer": optimizer_state(module, optimizer), "param_groups": optimizer_groups(module, optimizer),
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "rng": torch.get_rng_state()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    name = f"rank{rank}-{digest[:12]}.pt"
    atomic_write(step_dir / name, data)
    layers = tuple(int(n) for n in getattr(module, "_modules", {}))
    pol = {str(k): getattr(v, "value", v) for k, v in sorted((policies or {}).items())}
    return ShardInfo(rank=rank, file=name, sha256=digest, bytes=len(data), layers=layers,
                     optimizer=type(optimizer).__name__ if optimizer is not None else None, policies=pol)


def write_manifest(step_dir: str | os.PathLike[str], step: int, shards: Iterable[ShardInfo],
                   vpipe_state: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> Path:
    """Seal a checkpoint: the manifest (with its own sha256) goes last, atomically."""
    step_dir = Path(step_dir)
    shards = sorted(shards, key=lambda s: s.rank)
    state = dict(vpipe_state)
    policies = dict(state.get("policies", {}))
    for shard in shards:  # each rank knows its own layers' policies best
        policies.update(shard.policies)
    state["policies"] = policies
    check_vpipe_state(state, f"checkpoint {step_dir}")
    placed = sorted(lid for s in state["stages"] for lid in s)
    stored = sorted(lid for s in shards for lid in s.layers)
    if placed != stored:
        raise CheckpointError(f"checkpoint {step_dir}: the shards hold layers {stored}, the placement has {placed}")
    body = {"format": FORMAT, "version": VERSION, "step": step, "vpipe": state,
            "shards": [s.to_json() for s in shards], "extra": dict(extra or {})}
    manifest = dict(body, manifest_sha256=manifest_digest(body))
    path = step_dir / MANIFEST
    atomic_write(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return path


def save_checkpoint(root: str | os.PathLike[str], step: int, *, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None, rank: int, world_size: int, store: Any,
                    vpipe_state: Mapping[str, Any], extra: Mapping[str, Any] | None = None,
                    keep_last: int = 2, scheduler: Any = None) -> Path:
    """Collective: every rank writes its shard, rank 0 writes the manifest and prunes old checkpoints.

    ``vpipe_state`` is :meth:`vpipe.Vpipe.state_dict` (or the same map for a run without
    vpipe); shards are reported through ``store`` (the run's c10d store, no pickle).
    Returns the checkpoint directory.
    """
    step_dir = checkpoint_dir(root, step)
    policies = {int(k): v for k, v in vpipe_state.get("policies", {}).items()}
    mine = {lid: p for lid, p in policies.items() if str(lid) in getattr(module, "_modules", {})}
    shard = save_shard(step_dir, rank, module, optimizer, mine, scheduler)
    store.set(_SHARD_KEY.format(step, rank), json.dumps(shard.to_json()))
    if rank != 0:
        return step_dir
    raw = store.multi_get([_SHARD_KEY.format(step, r) for r in range(world_size)])
    shards = [ShardInfo.from_json(json.loads(r), str(step_dir)) for r in raw]
    write_manifest(step_dir, step, shards, vpipe_state, extra)
    keep = {s.file for s in shards} | {MANIFEST}
    for stale in step_dir.iterdir():  # shards of an earlier, unfinished attempt at this step
        if stale.name not in keep and not stale.name.startswith("."):
            stale.unlink(missing_ok=True)
    _prune(Path(root), keep_last)
    log.info("checkpoint after step %d written to %s", step, step_dir)
    return step_dir


def _prune(root: Path, keep_last: int) -> None:
    if keep_last < 1:
        return
    complete = [d for d in step_dirs(root) if (d / MANIFEST).exists()]
    if len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last]
    for d in step_dirs(root):
        if d.name < oldest_kept.name:
            shutil.rmtree(d, ignore_errors=True)
