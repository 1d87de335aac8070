"""Pipeline checkpoints: every rank writes its shard, rank 0 seals them with a manifest.

A checkpoint of the run after ``step`` steps is one directory::

    ROOT/step-00000120/
        rank0-3f9c2a1b7d40.pt     # torch.save of {"params": {name: tensor},
                                  #   "optimizer": {name: {key: value}},
                                  #   "param_groups": [{hyperparameters, "params": [names]}], "scheduler":
                                  {...}, #   "rng": this rank's torch RNG state}
        rank1-a81e0c55d2f3.pt     # names end with the first 12 hex digits of the file's sha256
        manifest.json             # format, version, step, vpipe state, the run that wrote it, and per shard:
                                  #   file, sha256, bytes, layers

Parameters are named ``"<global layer id>.<name in the layer>"`` (the stage modules are
``nn.Sequential``s named by layer id), optimizer state is keyed by the same names, so a
checkpoint does not depend on which stage held which layer: resuming on another number
of stages is re-placing the layers and loading each one by name. The optimizer's param
groups (learning rate, weight decay, betas...) are saved by parameter name too, with the
learning-rate scheduler's state and each rank's RNG state, so a resumed run continues
with the learning rate and random stream an uninterrupted run would have.

Writes are atomic: a shard goes to a new temporary file (never through a link), is fsynced
and renamed; rank 0 writes ``manifest.json`` the same way once every rank has reported its
shard's sha256 through the rendezvous store, and prunes only checkpoints of its own run (the
``run_id`` the manifest names). A checkpoint without a manifest is incomplete and never
loaded. Shard names carry their content hash, so a manifest can never point at a file
that a later, unfinished checkpoint overwrote. Loading verifies the manifest (its own
sha256) and every shard (size, sha256) before any state is touched, and raises
:class:`CheckpointError` naming the file that is missing, truncated or corrupted.

No pickle is read: shards are loaded with ``torch.load(..., weights_only=True)``, the
metadata is JSON.

The parts, one job each: ``layout.py`` (names, manifest entries, the vpipe state and their
validation; finding step directories), ``files.py`` (atomic writes, verified reads),
``save.py`` (shards and the manifest), ``load.py`` (a verified :class:`Checkpoint`) and
``restore.py`` (a stage's layers, optimizer, scheduler and RNG from one).
"""

from vpipe.checkpoint.files import atomic_write
from vpipe.checkpoint.layout import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    ShardInfo,
    check_vpipe_state,
    checkpoint_dir,
    find_latest,
    holds_checkpoints,
    manifest_run,
    resolve,
    skipped_newer,
)
from vpipe.checkpoint.load import Checkpoint, load_checkpoint
from vpipe.checkpoint.restore import restore_stage, stage_state
from vpipe.checkpoint.save import (
    optimizer_groups,
    optimizer_state,
    save_checkpoint,
    save_shard,
    write_manifest,
)

__all__ = [
    "FORMAT", "VERSION", "MANIFEST", "CheckpointError", "Checkpoint", "ShardInfo",
    "save_checkpoint", "save_shard", "write_manifest", "load_checkpoint", "find_latest", "resolve",
    "restore_stage", "stage_state", "check_vpipe_state", "optimizer_state", "checkpoint_dir",
    "holds_checkpoints", "skipped_newer", "atomic_write", "optimizer_groups", "manifest_run",
]
