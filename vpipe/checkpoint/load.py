"""Reading a checkpoint back: the manifest verified before any shard is used, shards verified as loaded.

:func:`load_checkpoint` checks the manifest (format, version, its own sha256, the vpipe
state, the shard entries) and each shard's type and size, or its whole sha256 too, and
returns a :class:`Checkpoint`; :meth:`Checkpoint.load_shards` reads the shards a stage
needs, without pickle (``torch.load(..., weights_only=True)``).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vpipe.checkpoint.files import check_file, read_verified, verify_shard
from vpipe.checkpoint.layout import (
    FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    VERSION,
    CheckpointError,
    ShardInfo,
    check_run_id,
    check_vpipe_state,
    manifest_digest,
    resolve,
)

__all__ = ["Checkpoint", "load_checkpoint"]


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: the manifest was checked and every shard's bytes match it."""

    path: Path
    step: int
    vpipe: dict[str, Any]
    shards: tuple[ShardInfo, ...]
    extra: dict[str, Any]
    run: str | None = None  # the id of the run that wrote it (None: written without one)

    @property
    def placement(self) -> list[list[int]]:
        return [list(s) for s in self.vpipe["stages"]]

    @property
    def num_stages(self) -> int:
        return len(self.vpipe["stages"])

    @property
    def layer_order(self) -> list[int]:
        return [lid for s in self.vpipe["stages"] for lid in s]

    def load_shards(self, layer_ids: Iterable[int] | None = None,
                    rng_rank: int | None = None) -> dict[str, Any]:
        """Merged ``{"params", "optimizer", "groups", "scheduler", "rng"}`` of the shards holding
        ``layer_ids`` (default all): ``groups`` maps each parameter name to its param group's
        hyperparameters, ``rng`` is rank ``rng_rank``'s RNG state (None if not asked for, or absent)."""
        wanted = None if layer_ids is None else set(layer_ids)
        params: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, Any]] = {}
        groups: dict[str, dict[str, Any]] = {}
        scheduler, rng = None, None
        for shard in self.shards:
            if wanted is not None and not wanted & set(shard.layers) and shard.rank != rng_rank:
                continue
            state = _load_shard(self.path / shard.file, shard)
            params.update(state["params"])
            optim.update(state["optimizer"])
            for group in state.get("param_groups") or []:
                hyper = {k: v for k, v in group.items() if k != "params"}
                groups.update({name: hyper for name in group["params"]})
            scheduler = scheduler or state.get("scheduler")
            if shard.rank == rng_rank:
                rng = state.get("rng")
        return {"params": params, "optimizer": optim, "groups": groups, "scheduler": scheduler, "rng": rng}


def _load_shard(path: Path, shard: ShardInfo) -> dict[str, Any]:
    data = read_verified(path, shard)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the bytes matched the manifest: a writer bug, still named
        raise CheckpointError(f"checkpoint shard {path} cannot be read: {type(e).__name__}: {e}") from None
    if not (isinstance(state, dict) and isinstance(state.get("params"), dict)
            and isinstance(state.get("optimizer"), dict)):
        raise CheckpointError(f"checkpoint shard {path} does not hold params and optimizer maps")
    return state


def load_checkpoint(path: str | os.PathLike[str], verify: str = "all") -> Checkpoint:
    """Read and verify a checkpoint (``path`` = a step directory or a root holding them).

    ``verify="all"``: every shard's type, size and sha256 are checked here (streamed, nothing
    kept), so a :class:`Checkpoint` that is returned is whole; nothing outside it is touched.
    ``verify="stat"`` (the ranks, after the launcher checked everything): type and size
    here, the sha256 of each shard when it is loaded, so a rank reads only the shards it
    needs, once each.
    """
    if verify not in ("all", "stat"):
        raise ValueError(f"verify must be 'all' or 'stat', got {verify!r}")
    step_dir = resolve(path)
    manifest_path = step_dir / MANIFEST
    check_file(manifest_path, "checkpoint manifest", limit=MAX_MANIFEST_BYTES)
    try:
        raw = manifest_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read checkpoint manifest {manifest_path}: {e}") from None
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is not valid JSON "
                              f"(truncated or corrupted): {e}") from None
    except RecursionError:
        raise CheckpointError(f"checkpoint manifest {manifest_path} nests its JSON too "
                              "deeply to be a manifest") \
            from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a vpipe checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"checkpoint manifest {manifest_path} has format version "
                              f"{manifest.get('version')!r}; this vpipe reads version {VERSION}")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != manifest_digest(body):
        raise CheckpointError(f"checkpoint manifest {manifest_path} is corrupted: its sha256 does not match "
                              "its contents")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint manifest {manifest_path} has a bad step {step!r}")
    state = check_vpipe_state(manifest.get("vpipe"), f"checkpoint manifest {manifest_path}")
    if not isinstance(manifest.get("shards"), list) or not manifest["shards"]:
        raise CheckpointError(f"checkpoint manifest {manifest_path} lists no shards")
    shards = tuple(ShardInfo.from_json(s, str(manifest_path)) for s in manifest["shards"])
    for shard in shards:
        if verify == "all":
            verify_shard(step_dir / shard.file, shard, keep=False)
        else:  # each shard is hashed when it is loaded: a rank reads only its own, once
            check_file(step_dir / shard.file, "checkpoint shard", size=shard.bytes)
    run = check_run_id(manifest.get("run"), f"checkpoint manifest {manifest_path}")
    return Checkpoint(path=step_dir, step=step, vpipe=state, shards=shards,
                      extra=dict(manifest.get("extra") or {}),
                      run=run)
