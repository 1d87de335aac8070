"""What a checkpoint is on disk: its names, the manifest's shard entries and vpipe state, and finding one.

Everything here is checked as it is read, so that writing and loading share one idea of a
valid checkpoint: :class:`ShardInfo` is a manifest's entry for one rank's shard,
:func:`check_vpipe_state` the vpipe state the manifest carries, and the step directories
under a root are found by name (``step-00000120``), a complete one by its manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vpipe.plan import Plan, PlanError, Policy

log = logging.getLogger("vpipe.checkpoint")

__all__ = [
    "FORMAT", "VERSION", "MANIFEST", "MAX_MANIFEST_BYTES", "CheckpointError", "ShardInfo",
           "check_vpipe_state",
    "checkpoint_dir", "manifest_digest", "step_dirs", "find_latest", "holds_checkpoints", "resolve",
           "skipped_newer",
    "check_run_id", "manifest_run",
]

FORMAT = "vpipe-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_MAX_RUN_ID = 128
MAX_MANIFEST_BYTES = 64 << 20


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
                       layers=tuple(data["layers"]), optimizer=data["optimizer"],
                       policies=dict(data["policies"]))
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


def check_run_id(run: Any, where: str) -> str | None:
    """A manifest's ``run``: the id of the run that wrote it (a run prunes only its own checkpoints), or
    None for a checkpoint written without one."""
    if run is None or (isinstance(run, str) and 0 < len(run) <= _MAX_RUN_ID and run.isprintable()):
        return run
    raise CheckpointError(f"{where}: run must be a short printable string, got {run!r:.80}")


def manifest_run(step_dir: Path) -> str | None:
    """The run id a complete checkpoint's manifest names; None when it names none or cannot be read (such a
    checkpoint is nobody's to prune)."""
    path = step_dir / MANIFEST
    try:
        if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        manifest = json.loads(path.read_text(encoding="utf-8"))
        return check_run_id(manifest.get("run"), str(path)) if isinstance(manifest, dict) else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def manifest_digest(body: Mapping[str, Any]) -> str:
    """The sha256 a manifest carries of itself (of everything but that field)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ====================================================================== step directories
def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def step_dirs(root: Path) -> list[Path]:
    """The step directories under ``root``, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and _STEP_DIR.match(d.name))


def find_latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint under ``root`` that has a manifest (complete), or None."""
    complete = [d for d in step_dirs(Path(root)) if (d / MANIFEST).exists()]
    return complete[-1] if complete else None


def holds_checkpoints(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint or holds step directories (complete or not): a run was here before."""
    path = Path(path)
    return (path / MANIFEST).exists() or (path.is_dir() and bool(step_dirs(path)))


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
    dirs = step_dirs(Path(root))
    latest = find_latest(root)
    return dirs[-1] if dirs and latest is not None and dirs[-1] != latest else None
