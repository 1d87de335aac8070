"""The plainest pipeline trainer: each rank wraps its slice of the layers as ``nn.Sequential(*layers[a:b])``.

Run with torchrun (one stage per rank)::

    torchrun --standalone --nproc-per-node 2 examples/train_sequential.py --steps 60
    torchrun --standalone --nproc-per-node 2 examples/train_sequential.py --steps 60 --vpipe

The children are named ``0..n-1`` on every rank; vpipe numbers the blocks globally by stage
order and, after a move, renumbers each slice ``0..n-1`` as a freshly built slice would be.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


class ResidualMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def batch(step: int, size: int, seq_len: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(size, seq_len, width, generator=gen)
    return x, x.roll(1, dims=1).tanh()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--partition", default="6,2", help="layers per stage")
    parser.add_argument("--width", type=int, default=int(os.environ.get("EXAMPLE_WIDTH", "64")))
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vpipe", action="store_true", help="attach vpipe (the one line below)")
    parser.add_argument("--no-planning", action="store_true",
                        help="with --vpipe: attach with planning=False (tensor manager and "
                             "monitor, no planner)")
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
    module = nn.Sequential(*layers[first:first + counts[rank]])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, args.micro_batches, loss_fn=F.mse_loss)

    if args.vpipe:
        import vpipe

        if args.no_planning:
            vpipe.attach(schedule, optimizer=optimizer, planning=False)
        else:
            vpipe.attach(schedule, optimizer=optimizer)  # the one line

    losses_per_step, step_s = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        x, y = batch(step, args.micro_batches * args.micro_batch_size, args.seq_len, args.width)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - started)
        if losses:
            losses_per_step.append([float(loss.detach()) for loss in losses])
    if args.out:
        torch.save(module.state_dict(), f"{args.out}.rank{rank}.pt")
        if rank == world - 1:
            with open(args.out, "w") as f:
                json.dump({"losses": losses_per_step, "step_s": step_s}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
