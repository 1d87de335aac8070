"""Pipeline checkpoints: every rank writes its shard, rank 0 seals them with a manifest.

A checkpoint of the run after ``step`` steps is one directory::

    ROOT/step-00000120/
        rank0-3f9c2a1b7d40.pt     # torch.save of {"params": {name: tensor}, "optimizer": {name: {key: value}},
                                  #   "param_groups": [{hyperparameters, "params": [names]}], "scheduler": {...},
                                  #   "rng": this rank's torch RNG state}
        rank1-a81e0c55d2f3.pt     # names end with the first 12 hex digits of the file's sha256
        manifest.json             # format, version, step, vpipe state, and per shard: file, sha256, bytes, layers

Parameters are named ``"<global layer id>.<name in the layer>"`` (the stage modules are
``nn.Sequential``s named by layer id), optimizer state is keyed by the same names, so a
checkpoint does not depend on which stage held which layer: resuming on another number
of stages is re-placing the layers and loading each one by name. The optimizer's param
groups (learning rate, weight decay, betas...) are saved by parameter name too, with the
learning-rate scheduler's state and each rank's RNG state, so a resumed run continues
with the learning rate and random stream an uninterrupted run would have.

Writes are atomic: a shard goes to a temporary file, is fsynced and renamed; rank 0
writes ``manifest.json`` the same way once every rank has reported its shard's sha256
through the rendezvous store. A checkpoint without a manifest is incomplete and never
loaded. Shard names carry their content hash, so a manifest can never point at a file
that a later, unfinished checkpoint overwrote. Loading verifies the manifest (its own
sha256) and every shard (size, sha256) before any state is touched, and raises
:class:`CheckpointError` naming the file that is missing, truncated or corrupted.

No pickle is read: shards are loaded with ``torch.load(..., weights_only=True)``, the
metadata is JSON.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vpipe.plan import Plan, PlanError, Policy

log = logging.getLogger("vpipe.checkpoint")

__all__ = [
    "FORMAT", "VERSION", "MANIFEST", "CheckpointError", "Checkpoint", "ShardInfo",
    "save_checkpoint", "save_shard", "write_manifest", "load_checkpoint", "find_latest", "resolve",
    "restore_stage", "stage_state", "check_vpipe_state", "optimizer_state", "checkpoint_dir",
]

FORMAT = "vpipe-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SHARD_KEY = "vpipe/checkpoint/{}/{}"
_SCALARS = (bool, int, float, type(None))


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded; the message names the file and the fault."""


@dataclass(frozen=True)
class ShardInfo:
    """One rank's shard as the manifest records it."""

    rank: int
    file: str
    sha256: str
    bytes: int
    layers: tuple[int, ...]
    optimizer: str | None
    policies: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "sha256": self.sha256, "bytes": self.bytes,
                "layers": list(self.layers), "optimizer": self.optimizer, "policies": dict(self.policies)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> ShardInfo:
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: a shard entry must be an object")
        try:
            info = cls(rank=data["rank"], file=data["file"], sha256=data["sha256"], bytes=data["bytes"],
                       layers=tuple(data["layers"]), optimizer=data["optimizer"], policies=dict(data["policies"]))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: a shard entry lacks or mistypes {e}") from None
        if not (isinstance(info.file, str) and "/" not in info.file and info.file not in ("", ".", "..")):
            raise CheckpointError(f"{where}: shard file name {info.file!r} is not a plain file name")
        if not (isinstance(info.bytes, int) and info.bytes >= 0 and isinstance(info.sha256, str)
                and re.fullmatch(r"[0-9a-f]{64}", info.sha256)):
            raise CheckpointError(f"{where}: shard {info.file!r} has a bad size or sha256")
        if not all(isinstance(lid, int) and not isinstance(lid, bool) and lid >= 0 for lid in info.layers):
            raise CheckpointError(f"{where}: shard {info.file!r} lists bad layer ids {list(info.layers)[:5]}")
        return info


# ====================================================================== vpipe state
def check_vpipe_state(state: Any, where: str = "vpipe state") -> dict[str, Any]:
    """Validate what :meth:`vpipe.Vpipe.state_dict` returns (also as read back from JSON)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} must be a map, got {type(state).__name__}")
    missing = sorted({"version", "epoch", "iteration", "stages", "policies", "next_layer_id"} - set(state))
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    if state["version"] != VERSION:
        raise CheckpointError(f"{where} has version {state['version']!r}; this vpipe reads version {VERSION}")
    for key in ("epoch", "iteration", "next_layer_id"):
        value = state[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{where}: {key} must be a non-negative integer, got {value!r}")
    if not isinstance(state["stages"], list) or not all(isinstance(s, list) for s in state["stages"]):
        raise CheckpointError(f"{where}: stages must be a list of lists of layer ids")
    if not isinstance(state["policies"], dict):
        raise CheckpointError(f"{where}: policies must map layer ids to D, S or R")
    try:
        policies = {int(k): Policy.parse(v) for k, v in state["policies"].items()}
        plan = Plan(epoch=state["epoch"], stages=tuple(tuple(s) for s in state["stages"]), policies=policies)
    except (PlanError, ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    if state["next_layer_id"] <= max(plan.layer_ids):
        raise CheckpointError(f"{where}: next_layer_id {state['next_layer_id']} is not above the largest "
                              f"layer id {max(plan.layer_ids)}")
    return state


# ====================================================================== writing
def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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


def _manifest_digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
    manifest = dict(body, manifest_sha256=_manifest_digest(body))
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
    complete = [d for d in _step_dirs(root) if (d / MANIFEST).exists()]
    if len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last]
    for d in _step_dirs(root):
        if d.name < oldest_kept.name:
            shutil.rmtree(d, ignore_errors=True)


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and _STEP_DIR.match(d.name))


# ====================================================================== reading
def find_latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint under ``root`` that has a manifest (complete), or None."""
    complete = [d for d in _step_dirs(Path(root)) if (d / MANIFEST).exists()]
    return complete[-1] if complete else None


def holds_checkpoints(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint or holds step directories (complete or not): a run was here before."""
    path = Path(path)
    return (path / MANIFEST).exists() or (path.is_dir() and bool(_step_dirs(path)))


def resolve(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one under it."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(f"no complete checkpoint (a step-* directory with a {MANIFEST}) in {path}")
    newer = skipped_newer(path)
    if newer is not None:  # an unfinished write, or a manifest lost since: never silently older
        log.info("%s has no %s (unfinished or damaged); using %s", newer, MANIFEST, latest.name)
    return latest


def skipped_newer(root: str | os.PathLike[str]) -> Path | None:
    """The newest step directory under ``root`` if it has no manifest but an older one has (else None)."""
    dirs = _step_dirs(Path(root))
    latest = find_latest(root)
    return dirs[-1] if dirs and latest is not None and dirs[-1] != latest else None


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: the manifest was checked and every shard's bytes match it."""

    path: Path
    step: int
    vpipe: dict[str, Any]
    shards: tuple[ShardInfo, ...]
    extra: dict[str, Any]

    @property
    def placement(self) -> list[list[int]]:
        return [list(s) for s in self.vpipe["stages"]]

    @property
    def num_stages(self) -> int:
        return len(self.vpipe["stages"])

    @property
    def layer_order(self) -> list[int]:
        return [lid for s in self.vpipe["stages"] for lid in s]

    def load_shards(self, layer_ids: Iterable[int] | None = None, rng_rank: int | None = None) -> dict[str, Any]:
        """Merged ``{"params", "optimizer", "groups", "scheduler", "rng"}`` of the shards holding ``layer_ids``
        (default all): ``groups`` maps each parameter name to its param group's hyperparameters, ``rng``
        is rank ``rng_rank``'s RNG state (None if not asked for, or absent)."""
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


_MAX_MANIFEST_BYTES = 64 << 20
_CHUNK = 4 << 20


def _check_file(path: Path, what: str, size: int | None = None, limit: int | None = None) -> None:
    """A regular file of the expected size, judged by ``stat`` before a byte is read (a FIFO would block
    a read forever, a padded file would be read whole)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{what} {path} is not a regular file")
    if size is not None and info.st_size != size:
        raise CheckpointError(f"{what} {path} is truncated or padded: {info.st_size} bytes, the manifest says {size}")
    if limit is not None and info.st_size > limit:
        raise CheckpointError(f"{what} {path} has {info.st_size} bytes, more than a manifest can ({limit})")


def _verify(path: Path, shard: ShardInfo, keep: bool) -> bytes | None:
    """Check a shard's type, size and sha256, reading it once in chunks; its bytes when ``keep``."""
    _check_file(path, "checkpoint shard", size=shard.bytes)
    digest, chunks = hashlib.sha256(), []
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                if keep:
                    chunks.append(chunk)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint shard {path}: {e.strerror}") from None
    if digest.hexdigest() != shard.sha256:
        raise CheckpointError(f"checkpoint shard {path} is corrupted: sha256 {digest.hexdigest()[:16]}..., "
                              f"the manifest says {shard.sha256[:16]}...")
    return b"".join(chunks) if keep else None


def _read_verified(path: Path, shard: ShardInfo) -> bytes:
    data = _verify(path, shard, keep=True)
    assert data is not None
    return data


def _load_shard(path: Path, shard: ShardInfo) -> dict[str, Any]:
    data = _read_verified(path, shard)
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
    _check_file(manifest_path, "checkpoint manifest", limit=_MAX_MANIFEST_BYTES)
    try:
        raw = manifest_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read checkpoint manifest {manifest_path}: {e}") from None
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is not valid JSON (truncated or corrupted): "
                              f"{e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a vpipe checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"checkpoint manifest {manifest_path} has format version {manifest.get('version')!r}; "
                              f"this vpipe reads version {VERSION}")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != _manifest_digest(body):
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
            _verify(step_dir / shard.file, shard, keep=False)
        else:  # each shard is hashed when it is loaded: a rank reads only its own, once
            _check_file(step_dir / shard.file, "checkpoint shard", size=shard.bytes)
    return Checkpoint(path=step_dir, step=step, vpipe=state, shards=shards, extra=dict(manifest.get("extra") or {}))


# ====================================================================== restoring
def stage_state(checkpoint: Checkpoint, module: nn.Module, rng_rank: int | None = None) -> dict[str, Any]:
    """The checkpoint's state for ``module``'s layers, checked against the module (nothing is loaded yet)."""
    layer_ids = [int(n) for n in module._modules]
    missing_layers = sorted(set(layer_ids) - set(checkpoint.layer_order))
    if missing_layers:
        raise CheckpointError(f"checkpoint {checkpoint.path} has no layers {missing_layers[:5]} "
                              f"(it holds {checkpoint.layer_order[:3]}...{checkpoint.layer_order[-1:]})")
    state = checkpoint.load_shards(layer_ids, rng_rank=rng_rank)
    own = module.state_dict()
    for name, target in own.items():
        value = state["params"].get(name)
        where = f"checkpoint {checkpoint.path}"
        if value is None:
            raise CheckpointError(f"{where} has no value for {name}")
        if value.shape != target.shape or value.dtype != target.dtype:
            raise CheckpointError(f"{where}: {name} is {tuple(value.shape)} {value.dtype} there, "
                                  f"{tuple(target.shape)} {target.dtype} in this model")
    named = dict(module.named_parameters())
    return {"params": {n: state["params"][n] for n in own},
            "optimizer": {n: s for n, s in state["optimizer"].items() if n in named},
            "groups": {n: g for n, g in state["groups"].items() if n in named},
            "scheduler": state["scheduler"], "rng": state["rng"]}


def _group_settings(checkpoint: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer,
                    saved: Mapping[str, dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Per param group of ``optimizer``: the saved hyperparameters of its parameters (None: none saved)."""
    names = {id(p): name for name, p in module.named_parameters()}
    out: list[dict[str, Any] | None] = []
    for g, group in enumerate(optimizer.param_groups):
        found = [saved[names[id(p)]] for p in group["params"] if names.get(id(p)) in saved]
        if not found:
            out.append(None)
            continue
        if any(_differs(f, found[0]) for f in found[1:]):
            raise CheckpointError(f"checkpoint {checkpoint.path}: the parameters of this stage's optimizer group {g} "
                                  "had different hyperparameters (learning rate, weight decay...) when saved")
        unknown = sorted(set(found[0]) - set(group))
        if unknown:
            raise CheckpointError(f"checkpoint {checkpoint.path}: its optimizer groups have {unknown}, this stage's "
                                  f"{type(optimizer).__name__} has not")
        out.append(found[0])
    return out


def _differs(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return True
    return any(not torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x != y
               for x, y in ((a[k], b[k]) for k in a))


def restore_stage(checkpoint: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                  scheduler: Any = None, *, rank: int | None = None) -> None:
    """Load this stage's layers' parameters, buffers, optimizer state and param-group hyperparameters,
    the learning-rate scheduler's state and, given the ``rank`` of a run on the checkpoint's
    number of stages, that rank's RNG state.

    Everything is checked first (shards, names, shapes, optimizer kind and groups); only then
    are values copied, so an error leaves ``module``, ``optimizer`` and ``scheduler`` as they were.
    """
    state = stage_state(checkpoint, module, rank)
    mine = set(module._modules)
    kinds = {s.optimizer for s in checkpoint.shards if {str(lid) for lid in s.layers} & mine}
    if optimizer is not None and state["optimizer"] and type(optimizer).__name__ not in kinds:
        raise CheckpointError(f"checkpoint {checkpoint.path} holds {sorted(k for k in kinds if k)} optimizer state, "
                              f"this stage's optimizer is {type(optimizer).__name__}")
    settings = _group_settings(checkpoint, module, optimizer, state["groups"]) if optimizer is not None else []
    if scheduler is not None and state["scheduler"] is None and checkpoint.step > 0:
        log.warning("checkpoint %s has no learning-rate scheduler state; the scheduler starts over", checkpoint.path)
    with torch.no_grad():
        for name, target in module.state_dict(keep_vars=True).items():
            target.copy_(state["params"][name])
    if optimizer is not None:
        params = dict(module.named_parameters())
        for name, values in state["optimizer"].items():
            p = params[name]
            # per-element state (moments) lives with its parameter; scalars (Adam's step) stay on the CPU
            optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                  for k, v in values.items()}
        for group, saved in zip(optimizer.param_groups, settings):
            if saved is not None:
                group.update(saved)  # in place: a scheduler holding the optimizer sees the restored values
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if state["rng"] is not None:
        torch.set_rng_state(state["rng"])
