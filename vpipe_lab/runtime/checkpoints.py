"""The reference trainer's checkpoints: the directory checked at launch, resuming from one, saving one.

A resume is checked against the run before any rank builds its stages (the model, the
optimizer and the layer order must be the saved ones) and decides where the layers go;
saving is the collective :func:`vpipe.checkpoint.save_checkpoint` with this run's state.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import Any

from vpipe.checkpoint import (
    VERSION,
    CheckpointError,
    holds_checkpoints,
    load_checkpoint,
    save_checkpoint,
    skipped_newer,
)
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.launch import Distributed
from vpipe_lab.runtime.stage_run import StageRun

__all__ = ["load_resume", "check_checkpoint_dir", "resume_placement", "save_run_checkpoint"]


def load_resume(cfg: RunConfig, verify: str = "stat") -> Any:
    """The verified checkpoint ``cfg.resume`` names, checked against ``cfg`` (CheckpointError otherwise).

    None when the directory holds no checkpoint at all yet: the first run of a job that is
    always launched with ``--resume`` (torchrun's restart pattern) starts from step 0.
    ``verify`` is :func:`~vpipe.checkpoint.load_checkpoint`'s: the launcher checks every shard,
    a rank hashes the shards it loads.
    """
    if not holds_checkpoints(cfg.resume or ""):
        return None
    ckpt = load_checkpoint(cfg.resume or "", verify=verify)
    newer = skipped_newer(cfg.resume or "")
    if newer is not None and verify == "all":  # the launcher says it once; ranks log it
        print(f"vpipe: {newer} has no manifest.json (unfinished or damaged); resuming from {ckpt.path.name}",
              file=sys.stderr)
    if ckpt.layer_order != list(range(cfg.n_layers)):
        raise CheckpointError(f"checkpoint {ckpt.path} holds layers {ckpt.layer_order[:3]}...{ckpt.layer_order[-1:]} "
                              f"in that order; this run's model has layers 0..{cfg.n_layers - 1}")
    if ckpt.step > cfg.steps:
        raise CheckpointError(f"checkpoint {ckpt.path} is after step {ckpt.step}, beyond --steps {cfg.steps}")
    saved = ckpt.extra.get("run_config")
    if isinstance(saved, dict):  # the model and optimizer must be the ones that were saved
        for name in ("model", "blocks", "d_model", "n_heads", "seq_len", "block_types", "optimizer"):
            if name in saved and saved[name] != getattr(cfg, name):
                raise CheckpointError(f"checkpoint {ckpt.path} was saved with {name} {saved[name]!r}; this run has "
                                      f"{getattr(cfg, name)!r}")
    return ckpt


LOCK_NAME = ".vpipe-lock"
_held: list[int] = []  # this process's lock on its checkpoint directory, held until it exits


def check_checkpoint_dir(cfg: RunConfig, *, hold: bool = False) -> None:
    """--checkpoint-dir must be writable and used by no other run: found at launch, not at the first checkpoint
    hours later. Rank 0 (``hold``) keeps the directory's lock for the run: two runs sharing one would prune each
    other's checkpoints."""
    if not cfg.checkpoint_dir:
        return
    root = Path(cfg.checkpoint_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(f"--checkpoint-dir {root} is not writable: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = os.read(fd, 64).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise CheckpointError(f"--checkpoint-dir {root} is in use by another run (pid {owner}); give each run a "
                              f"directory of its own") from None
    if not hold:
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held.append(fd)


def resume_placement(cfg: RunConfig, ckpt: Any) -> list[list[int]]:
    """Where the layers go on resume: ``cfg.partition`` if given, the checkpoint's placement on the
    same number of (virtual) stages, else an even split (the planner rebalances from there)."""
    if cfg.partition is None and ckpt.num_stages == cfg.virtual_stages:
        return ckpt.placement
    return cfg.stage_layer_ids()


def save_run_checkpoint(cfg: RunConfig, run: StageRun, ctx: Distributed, vp: Any, steps_done: int,
                        placement: list[list[int]]) -> None:
    """Collective: this rank's shard of the checkpoint after ``steps_done`` steps (rank 0 seals it).

    ``placement`` is the run's fixed placement when vpipe is off (vpipe knows its own)."""
    if vp is not None:
        state = vp.state_dict()
    else:
        state = {"version": VERSION, "epoch": 0, "iteration": steps_done, "stages": placement, "policies": {},
                 "next_layer_id": cfg.n_layers}
    state["iteration"] = steps_done
    save_checkpoint(cfg.checkpoint_dir or ".", steps_done, module=run.layers_view(), optimizer=run.optimizer,
                    rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, vpipe_state=state,
                    extra={"run_config": cfg.to_dict()}, scheduler=run.scheduler)
