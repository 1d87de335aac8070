"""Writing a checkpoint: every rank its shard, rank 0 the manifest that seals them, then pruning.

A shard holds one rank's parameters and buffers, its optimizer state and param groups by
parameter name, the learning-rate scheduler's state and the rank's RNG state. The ranks
report their shards' entries through the run's store (or the error that stopped one); rank 0
checks that the shards hold exactly the placed layers, writes the manifest last and keeps the
newest complete checkpoints of its run: a manifest names the run that wrote it (``run_id``),
and a run prunes only its own.
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

from vpipe.checkpoint.files import atomic_write, make_step_dir
from vpipe.checkpoint.layout import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    ShardInfo,
    check_run_id,
    check_vpipe_state,
    checkpoint_dir,
    manifest_digest,
    manifest_run,
    step_dirs,
)
from vpipe.compat.torch_internals import child_modules

log = logging.getLogger("vpipe.checkpoint")

__all__ = ["optimizer_state", "optimizer_groups", "save_shard", "write_manifest", "save_checkpoint"]

_SHARD_KEY = "vpipe/checkpoint/{}/{}"
_SCALARS = (bool, int, float, type(None))
# (root, run id) -> the step directories this process began as rank 0:
# its own unfinished attempts, which it prunes
_attempted: dict[tuple[str, str | None], set[str]] = {}


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
    make_step_dir(step_dir)
    state = {"params": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
             "optimizer": optimizer_state(module, optimizer),
             "param_groups": optimizer_groups(module, optimizer),
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "rng": torch.get_rng_state()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    name = f"rank{rank}-{digest[:12]}.pt"
    atomic_write(step_dir / name, data)
    layers = tuple(int(n) for n in child_modules(module))
    pol = {str(k): getattr(v, "value", v) for k, v in sorted((policies or {}).items())}
    return ShardInfo(rank=rank, file=name, sha256=digest, bytes=len(data), layers=layers,
                     optimizer=type(optimizer).__name__ if optimizer is not None else None, policies=pol)


def write_manifest(step_dir: str | os.PathLike[str], step: int, shards: Iterable[ShardInfo],
                   vpipe_state: Mapping[str, Any], extra: Mapping[str, Any] | None = None,
                   run_id: str | None = None) -> Path:
    """Seal a checkpoint: the manifest (with its own sha256, and the id of the run that wrote it) goes last,
    atomically."""
    step_dir = Path(step_dir)
    check_run_id(run_id, f"checkpoint {step_dir}")
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
        raise CheckpointError(f"checkpoint {step_dir}: the shards hold layers {stored}, the "
                              f"placement has {placed}")
    body = {"format": FORMAT, "version": VERSION, "step": step, "vpipe": state,
            "shards": [s.to_json() for s in shards], "extra": dict(extra or {})}
    if run_id is not None:
        body["run"] = run_id
    manifest = dict(body, manifest_sha256=manifest_digest(body))
    path = step_dir / MANIFEST
    atomic_write(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return path


def save_checkpoint(root: str | os.PathLike[str], step: int, *, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None, rank: int, world_size: int, store: Any,
                    vpipe_state: Mapping[str, Any], extra: Mapping[str, Any] | None = None,
                    keep_last: int = 2, scheduler: Any = None, run_id: str | None = None) -> Path:
    """Collective: every rank writes its shard, rank 0 writes the manifest and prunes old checkpoints.

    ``vpipe_state`` is :meth:`vpipe.Vpipe.state_dict` (or the same map for a run without
    vpipe); shards are reported through ``store`` (the run's c10d store, no pickle).
    ``run_id`` (rank 0's) names the run in the manifest: rank 0 keeps the ``keep_last`` newest
    checkpoints of this run up to ``step`` and prunes older ones of this run only, never another
    run's (a checkpoint without an id belongs to the runs that give none).
    Returns the checkpoint directory. A rank that cannot write its shard (a full disk) reports
    that through the store and raises its OSError; rank 0 then writes no manifest and raises an
    OSError naming the rank, so no rank waits for a shard that will never come.
    """
    step_dir = checkpoint_dir(root, step)
    policies = {int(k): v for k, v in vpipe_state.get("policies", {}).items()}
    mine = {lid: p for lid, p in policies.items() if str(lid) in child_modules(module)}
    if rank == 0:
        _attempted.setdefault((str(root), run_id), set()).add(step_dir.name)
    try:
        shard = save_shard(step_dir, rank, module, optimizer, mine, scheduler)
    except OSError as e:
        store.set(_SHARD_KEY.format(step, rank), json.dumps({"error": e.strerror or str(e)}))
        raise
    store.set(_SHARD_KEY.format(step, rank), json.dumps(shard.to_json()))
    if rank != 0:
        return step_dir
    raw = [json.loads(r) for r in store.multi_get([_SHARD_KEY.format(step, r) for r in range(world_size)])]
    failed = [f"rank {r} could not write its shard ({entry['error']})" for r, entry in enumerate(raw)
              if isinstance(entry, dict) and "error" in entry]
    if failed:
        raise OSError(f"checkpoint {step_dir} not sealed: {'; '.join(failed)}")
    shards = [ShardInfo.from_json(entry, str(step_dir)) for entry in raw]
    write_manifest(step_dir, step, shards, vpipe_state, extra, run_id=run_id)
    keep = {s.file for s in shards} | {MANIFEST}
    for stale in step_dir.iterdir():  # shards of an earlier, unfinished attempt at this step
        if stale.name not in keep and not stale.name.startswith("."):
            stale.unlink(missing_ok=True)
    _prune(Path(root), keep_last, step_dir, run_id)
    log.info("checkpoint after step %d written to %s", step, step_dir)
    return step_dir


def _prune(root: Path, keep_last: int, newest: Path, run_id: str | None) -> None:
    """Remove this run's checkpoints older than its ``keep_last`` newest up to ``newest`` (the one just
    sealed), and the unfinished attempts this process made before them. Another run's checkpoints, and this
    run's after ``newest`` (a resume from an older one), are not this prune's to remove."""
    if keep_last < 1:
        return
    ours = [d for d in step_dirs(root) if d.name <= newest.name and (d / MANIFEST).exists()
            and manifest_run(d) == run_id]
    if len(ours) <= keep_last:
        return
    oldest_kept = ours[-keep_last]
    attempted = _attempted.get((str(root), run_id), set())
    for d in step_dirs(root):
        if d.name >= oldest_kept.name:
            continue
        if d in ours or (d.name in attempted and not (d / MANIFEST).exists()):
            shutil.rmtree(d, ignore_errors=True)
            attempted.discard(d.name)
