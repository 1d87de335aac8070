"""Rank program for tests/integration/test_stream_checkpoints.py: vpipe's checkpoints under the streams that
update once a period (``vpipe.SchedulePipeDream2BW``, ``vpipe.ScheduleWPipe``).

``argv``: SCHEDULE (``2bw`` or ``wpipe``), PART (``first``: the run ``whole``, every step,
flushing before step ``SAVE_AT`` and saving nothing, then the run ``first``, the steps before
``SAVE_AT``, ``flush()`` and a checkpoint; ``second``: fresh processes that restore that
checkpoint, attach, load vpipe's state and train on), the checkpoint root, and OUT (each
rank writes ``OUT.rankR.pt``, for each run its parameters after the final flush, the last
rank's losses of the steps it ran, the step vpipe counted last, and why ``vp.state_dict()``
was refused before that flush). Adam, planning off, every block recomputed under vpipe.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

import vpipe
from support import twobw, wpipe
from support.twobw import feed_step, make_optimizer
from vpipe.checkpoint import load_checkpoint, restore_stage, save_checkpoint
from vpipe.compat.torch_distributed import default_store

STEPS, SAVE_AT = 6, 3


def build(schedule: str) -> tuple[list[nn.Module], Any, torch.optim.Optimizer]:
    """This rank's stage modules, the schedule over them and its optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if schedule == "2bw":
        modules = [twobw.stage_module(rank, world)]
        stages = [PipelineStage(modules[0], rank, world, torch.device("cpu"))]
    else:
        modules = [wpipe.stage_module(rank), wpipe.stage_module(world + rank)]
        stages = [PipelineStage(m, v, 2 * world, torch.device("cpu"))
                  for m, v in zip(modules, (rank, world + rank))]
    optimizer = make_optimizer("adam", [p for m in modules for p in m.parameters()])
    if schedule == "2bw":
        return modules, vpipe.SchedulePipeDream2BW(stages[0], twobw.MICRO_BATCHES, F.mse_loss,
                                                   optimizer), optimizer
    return modules, vpipe.ScheduleWPipe(stages, wpipe.MICRO_BATCHES, F.mse_loss, optimizer), optimizer


def layers_view(modules: list[nn.Module]) -> nn.Module:
    """The rank's blocks of every stage in one module, by global layer id (a rank's shard holds them all)."""
    return nn.Sequential(OrderedDict((name, child) for m in modules for name, child in m.named_children()))


def train(schedule_name: str, part: str, root: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    modules, schedule, optimizer = build(schedule_name)
    layers = twobw.LAYERS if schedule_name == "2bw" else wpipe.layers(world)
    ckpt = None
    if part == "second":
        ckpt = load_checkpoint(root)
        restore_stage(ckpt, layers_view(modules), optimizer, rank=rank)
    vp = vpipe.attach(schedule, optimizer=optimizer, planning=False,
                      policies=dict.fromkeys(range(layers), "R"))
    if ckpt is not None:
        vp.load_state_dict(ckpt.vpipe)
    steps = {"first": range(SAVE_AT), "second": range(SAVE_AT, STEPS), "whole": range(STEPS)}[part]
    losses = []
    for step in steps:
        if step == SAVE_AT and part == "whole":
            schedule.flush()  # where the interrupted run flushed to save
        losses.append(feed_step(schedule, step))
    refused = None
    try:  # a stream's state is saved only once flushed: what is in flight would be lost
        vp.state_dict()
    except RuntimeError as e:
        refused = str(e)
    schedule.flush()
    if part == "first":
        save_checkpoint(root, SAVE_AT, module=layers_view(modules), optimizer=optimizer, rank=rank,
                        world_size=world, store=default_store(), vpipe_state=vp.state_dict())
    state = [(k, v.detach().clone()) for m in modules for k, v in m.state_dict().items()]
    result = {"state": state, "losses": losses, "iteration": vp.iteration, "refused": refused}
    vp.detach()
    return result


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    schedule_name, part, root, out = sys.argv[1:5]
    # one launch: the whole run, then the first part and its checkpoint; the second part: a launch of its own
    parts = ("whole", "first") if part == "first" else (part,)
    runs = {name: train(schedule_name, name, root) for name in parts}
    torch.save(runs, f"{out}.rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
