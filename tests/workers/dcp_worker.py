"""Rank program for tests/integration/test_dcp.py: a trainer's own DCP checkpoint after vpipe moved its blocks
(2 ranks).

``argv``: the shape (``tutorial``: the tutorial's ``ModuleDict`` keyed by global id;
``sequential``: an ``nn.Sequential`` slice numbered ``0..n-1`` on every rank), the output JSON
and a checkpoint directory. The trainer starts on a 6,2 split with the one line
``vpipe.attach(schedule, optimizer=opt)`` and trains until vpipe has moved blocks; then it
saves the model and the optimizer the way torchtitan does (``get_state_dict`` with flattened
optimizer state, ``torch.distributed.checkpoint.save``) and trains on: the run that never
stopped. The same trainer without vpipe is then built fresh on 6,2 and on 2,6, loads the
checkpoint (``dcp.load`` + ``set_state_dict``) and trains the same steps. The sequential
trainer renames its block keys to global layer ids around the save and the load
(``vpipe.global_block_keys`` / ``vpipe.local_block_keys``), and saves a second checkpoint
without renaming, to show what goes wrong then: the blocks each checkpoint holds are reported.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from shape_worker import _train_step, run_ranks, seq_example, tut
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

AFTER = 3  # steps trained after the checkpoint
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # every optimizer value keyed by its parameter


def _build(shape: str, counts: list[int]) -> tuple[nn.Module, torch.optim.Optimizer, Schedule1F1B]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if shape == "tutorial":
        module: nn.Module = tut.split_model(tut.Transformer(tut.ModelArgs()), rank, counts)
        loss_fn = tut.tokenwise_loss_fn
    else:
        layers = [seq_example.ResidualMLP(64) for _ in range(sum(counts))]
        first = sum(counts[:rank])
        module = nn.Sequential(*layers[first:first + counts[rank]])
        loss_fn = F.mse_loss
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    return module, optimizer, Schedule1F1B(stage, 4, loss_fn=loss_fn)


def _step(shape: str, schedule: Schedule1F1B, optimizer: torch.optim.Optimizer, step: int) -> list[float]:
    if shape == "tutorial":
        return _train_step(schedule, optimizer, step)
    x, y = seq_example.batch(step, 8, 32, 64)
    losses: list[torch.Tensor] = []
    schedule.step(x) if dist.get_rank() == 0 else schedule.step(target=y, losses=losses)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [float(loss.detach()) for loss in losses]


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, layer_ids: list[int] | None) -> None:
    import vpipe

    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    if layer_ids is not None:
        model_sd, optim_sd = vpipe.global_block_keys(model_sd, layer_ids), vpipe.global_block_keys(optim_sd,
                                                                                                   layer_ids)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, layer_ids: list[int] | None) -> None:
    import vpipe

    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    if layer_ids is not None:
        model_sd, optim_sd = vpipe.global_block_keys(model_sd, layer_ids), vpipe.global_block_keys(optim_sd,
                                                                                                   layer_ids)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    model_sd, optim_sd = state["model"], state["optim"]
    if layer_ids is not None:
        model_sd, optim_sd = vpipe.local_block_keys(model_sd, layer_ids), vpipe.local_block_keys(optim_sd,
                                                                                                 layer_ids)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=OPTIONS)


def run(shape: str, path: str) -> dict:
    import vpipe

    rank = dist.get_rank()
    named = shape == "sequential"  # block keys renamed to global ids around save and load
    model, optimizer, schedule = _build(shape, [6, 2])
    vp = vpipe.attach(schedule, optimizer=optimizer, sample_every=2, planner_options={"warmup_samples": 1})
    start = list(vp.layer_ids)
    step = 0
    while step < 100 and (vp.layer_manager.epoch < 1 or vp.layer_ids == start):
        _step(shape, schedule, optimizer, step)
        step += 1
    moved_to = list(vp.layer_ids)
    _save(model, optimizer, path, moved_to if named else None)
    if named:
        _save(model, optimizer, path + "-unnamed", None)
    never_stopped = [_step(shape, schedule, optimizer, s) for s in range(step, step + AFTER)]
    vp.detach()
    resumed = {}
    for counts in ([6, 2], [2, 6]):
        model, optimizer, schedule = _build(shape, counts)
        first = sum(counts[:rank])
        _load(model, optimizer, path, list(range(first, first + counts[rank])) if named else None)
        resumed[",".join(map(str, counts))] = [_step(shape, schedule, optimizer, s)
                                               for s in range(step, step + AFTER)]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"moved_to": moved_to, "saved_at": step, "never_stopped": never_stopped,
                                      "resumed": resumed})
    held = {name: _blocks_held(p) for name, p in (("named", path), ("unnamed", path + "-unnamed"))
            if Path(p).exists()}
    return {"ranks": gathered, "blocks_in_checkpoint": held}


def rollback(path: str) -> dict:
    """A trainer that rolls back to a snapshot after a loss spike, across a move: vpipe's copy snapshots
    with DCP and global block keys at step 2 on 6,2, trains on until vpipe has moved blocks, tries the
    plain trainer's rollback (``load_state_dict`` of a deep copy taken at step 2: refused in one line),
    then loads the DCP snapshot into the blocks wherever they are now and replays steps 2..; the plain copy
    rolls back with its deep copies. Both must train the replayed steps alike, bitwise."""
    import copy

    import vpipe
    from vpipe.rank.stamps import StaleStateError

    model, optimizer, schedule = _build("sequential", [6, 2])
    vp = vpipe.attach(schedule, optimizer=optimizer, sample_every=2, planner_options={"warmup_samples": 1})
    for step in range(2):
        _step("sequential", schedule, optimizer, step)
    snapshot_ids = list(vp.layer_ids)
    _save(model, optimizer, path, snapshot_ids)
    stale = copy.deepcopy(model.state_dict())
    step = 2
    while step < 100 and (vp.layer_manager.epoch < 1 or vp.layer_ids == snapshot_ids):
        _step("sequential", schedule, optimizer, step)
        step += 1
    moved_to = list(vp.layer_ids)
    try:
        model.load_state_dict(stale)
        refusal = None
    except StaleStateError as e:
        refusal = str(e)
    _load(model, optimizer, path, moved_to)
    replayed = [_step("sequential", schedule, optimizer, s) for s in range(2, 2 + AFTER)]
    vp.detach()
    model, optimizer, schedule = _build("sequential", [6, 2])
    for step in range(2):
        _step("sequential", schedule, optimizer, step)
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    for s in range(2, 2 + AFTER):
        _step("sequential", schedule, optimizer, s)
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    plain = [_step("sequential", schedule, optimizer, s) for s in range(2, 2 + AFTER)]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"snapshot": snapshot_ids, "moved_to": moved_to, "refusal": refusal,
                                      "replayed": replayed, "plain": plain})
    return {"ranks": gathered}


def _blocks_held(path: str) -> list[str]:
    """The distinct blocks a checkpoint holds weights of: model keys up to their block index."""
    held = set()
    for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        parts = key.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if parts[0] == "model" and index is not None:
            held.add(".".join(parts[:index + 1]))
    return sorted(held)


def main() -> None:
    shape, out, path = sys.argv[1], sys.argv[2], sys.argv[3]
    run_ranks(lambda: rollback(path) if shape == "rollback" else run(shape, path), out)


if __name__ == "__main__":
    main()
