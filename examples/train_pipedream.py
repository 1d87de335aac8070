"""A PipeDream trainer (asynchronous 1F1B with weight stashing) on vpipe's ``SchedulePipeDream``.

Run with torchrun (one stage per rank)::

    torchrun --standalone --nproc-per-node 2 examples/train_pipedream.py --steps 40
    torchrun --standalone --nproc-per-node 2 examples/train_pipedream.py --steps 40 --vpipe
    torchrun --standalone --nproc-per-node 2 examples/train_pipedream.py --vpipe --no-planning --move 3:4,4

Each rank holds an ``nn.Sequential`` slice whose children are named by global layer id, the
shape vpipe's streamed moves work on: a layer moves between neighbours without a flush while
the other micro-batches stay in flight. ``--move STEP:COUNTS`` asks for one such move (the same
on every rank); with ``--vertical-sync`` every micro-batch runs one weight version on all
stages, so the result does not depend on where the layers were.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

import vpipe
from train_sequential import ResidualMLP, batch  # the same model and data as the plainest trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--partition", default="6,2", help="layers per stage")
    parser.add_argument("--width", type=int, default=int(os.environ.get("EXAMPLE_WIDTH", "64")))
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vertical-sync", action="store_true")
    parser.add_argument("--vpipe", action="store_true", help="attach vpipe (the one line below)")
    parser.add_argument("--no-planning", action="store_true",
                        help="with --vpipe: no planner (moves only by --move)")
    parser.add_argument("--move", default=None, help="with --vpipe: STEP:COUNTS, e.g. 3:4,4")
    parser.add_argument("--out", default=None,
                        help="write the losses and this stage's state here (JSON + .pt)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [int(c) for c in args.partition.split(",")]
    if len(counts) != world:
        raise SystemExit(f"--partition {args.partition} names {len(counts)} stages for {world} ranks")
    torch.manual_seed(0)
    layers = [ResidualMLP(args.width) for _ in range(sum(counts))]  # the whole model, on every rank
    first = sum(counts[:rank])
    module = nn.Sequential(OrderedDict((str(i), layers[i]) for i in range(first, first + counts[rank])))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    schedule = vpipe.SchedulePipeDream(stage, args.micro_batches, F.mse_loss, optimizer,
                                       vertical_sync=args.vertical_sync)

    if args.vpipe:
        vp = vpipe.attach(schedule, optimizer=optimizer, planning=not args.no_planning)  # the one line
        if args.move:
            step, target = args.move.split(":")
            sizes, ids = [int(c) for c in target.split(",")], iter(range(sum(counts)))
            stages = tuple(tuple(next(ids) for _ in range(n)) for n in sizes)
            vp.request_plan(vpipe.Plan(epoch=1, stages=stages), at_step=int(step))

    losses_per_step = []
    for step in range(args.steps):
        x, y = batch(step, args.micro_batches * args.micro_batch_size, args.seq_len, args.width)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if losses:
            losses_per_step.append([float(loss.detach()) for loss in losses])
    schedule.flush()  # the micro-batches still in flight run their backward and update
    if args.out:
        torch.save(module.state_dict(), f"{args.out}.rank{rank}.pt")
        if rank == world - 1:
            with open(args.out, "w") as f:
                json.dump({"losses": losses_per_step}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
