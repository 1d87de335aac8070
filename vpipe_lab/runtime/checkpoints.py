"""The reference trainer's checkpoints: the directory checked at launch, resuming from one, saving one.

A resume is checked against the run before any rank builds its stages (the model, the
optimizer and the layer order must be the saved ones) and decides where the layers go;
saving is the collective :func:`vpipe.checkpoint.save_checkpoint` with this run's state.

The directory belongs to one run: rank 0 holds its lock (never opened through a link) for
the whole run, a directory holding another run's checkpoints is refused at launch unless
``--resume`` names it, and rank 0 names its run in every manifest (a resumed run keeps the
id of the run it continues), so it prunes only its own. A checkpoint that cannot be written
(a full disk) is said once per rank and the run's later checkpoints are dropped on every
rank alike (rank 0 tells the others through the store): training goes on.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any

from vpipe.checkpoint import (
    VERSION,
    CheckpointError,
    find_latest,
    holds_checkpoints,
    load_checkpoint,
    manifest_run,
    resolve,
    save_checkpoint,
    skipped_newer,
)
from vpipe_lab.runtime.config import RunConfig
from vpipe_lab.runtime.launch import Distributed
from vpipe_lab.runtime.outputs import keep, lock_directory
from vpipe_lab.runtime.stage_run import StageRun
from vpipe_lab.runtime.watchdog import stderr_line

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
        raise CheckpointError(f"checkpoint {ckpt.path} holds layers "
                              f"{ckpt.layer_order[:3]}...{ckpt.layer_order[-1:]} "
                              f"in that order; this run's model has layers 0..{cfg.n_layers - 1}")
    if ckpt.step > cfg.steps:
        raise CheckpointError(f"checkpoint {ckpt.path} is after step {ckpt.step}, beyond --steps {cfg.steps}")
    saved = ckpt.extra.get("run_config")
    if isinstance(saved, dict):  # the model and optimizer must be the ones that were saved
        for name in ("model", "blocks", "d_model", "n_heads", "seq_len", "block_types", "optimizer"):
            if name in saved and saved[name] != getattr(cfg, name):
                raise CheckpointError(f"checkpoint {ckpt.path} was saved with {name} "
                                      f"{saved[name]!r}; this run has {getattr(cfg, name)!r}")
    return ckpt


_run: dict[str, str | None] = {}  # rank 0: "id", the run its manifests name
_saving: dict[str, Any] = {"last": None, "dropped": False}  # every rank: the last checkpoint tried; given up?
_SEALED_KEY = "vpipe/lab/checkpoint/{}/sealed"


def check_checkpoint_dir(cfg: RunConfig, *, hold: bool = False) -> None:
    """--checkpoint-dir must be writable, used by no other run and hold no other run's checkpoints (unless
    --resume names it): found at launch, not at the first checkpoint hours later. Rank 0 (``hold``) keeps the
    directory's lock for the run and takes the run id its manifests carry."""
    if not cfg.checkpoint_dir:
        return
    root = Path(cfg.checkpoint_dir)
    fd = lock_directory(root, "--checkpoint-dir", CheckpointError)  # the lock every run's outputs take
    latest = find_latest(root)
    # its checkpoints would mix with ours, or be pruned
    if latest is not None and not _resumes_from(cfg, root):
        os.close(fd)
        raise CheckpointError(
            f"--checkpoint-dir {root} holds another run's checkpoints (the newest: {latest.name}); "
            f"give this run a directory of its own, or --resume {root} to continue that run"
        )
    keep(fd, hold)
    if hold:
        _run["id"] = _resumed_run_id(cfg) if cfg.resume else uuid.uuid4().hex


def _resumes_from(cfg: RunConfig, root: Path) -> bool:
    """Whether --resume names ``root`` or one of its checkpoints."""
    if not cfg.resume:
        return False
    resume, here = Path(cfg.resume).resolve(), root.resolve()
    return resume == here or resume.parent == here


def _resumed_run_id(cfg: RunConfig) -> str | None:
    """The id of the run a resume continues (its checkpoint's; None for one written without an id), or a new
    id when there is nothing to resume yet."""
    try:
        return manifest_run(resolve(cfg.resume or ""))
    except CheckpointError:
        return uuid.uuid4().hex


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
    if _dropped(ctx):
        return
    if vp is not None:
        state = vp.state_dict()
    else:
        state = {"version": VERSION, "epoch": 0, "iteration": steps_done, "stages": placement, "policies": {},
                 "next_layer_id": cfg.n_layers}
    state["iteration"] = steps_done
    sealed = False
    try:
        save_checkpoint(cfg.checkpoint_dir or ".", steps_done, module=run.layers_view(),
                        optimizer=run.optimizer,
                        rank=ctx.rank, world_size=ctx.world_size, store=ctx.store, vpipe_state=state,
                        extra={"run_config": cfg.to_dict()}, scheduler=run.scheduler, run_id=_run.get("id"))
        sealed = True
    # a full disk, a name in the way: said once, and training goes on without checkpoints
    except OSError as e:
        _saving["dropped"] = True
        stderr_line(f"vpipe [rank {ctx.rank}]: cannot write the checkpoint after step {steps_done} in "
                    f"{cfg.checkpoint_dir} ({e.strerror or e}); training goes on without checkpoints")
    finally:
        _saving["last"] = steps_done
        if ctx.rank == 0:  # sealed or not: the other ranks read it before their next checkpoint
            ctx.store.set(_SEALED_KEY.format(steps_done), "1" if sealed else "0")


def _dropped(ctx: Distributed) -> bool:
    """Whether this run's checkpoints were given up: after one that rank 0 could
    not seal, every rank skips the rest alike (a rank that went on would wait for
    shards that never come, or leave shards nobody seals)."""
    if not _saving["dropped"] and ctx.rank != 0 and _saving["last"] is not None:
        _saving["dropped"] = ctx.store.get(_SEALED_KEY.format(_saving["last"])) != b"1"
    return bool(_saving["dropped"])
