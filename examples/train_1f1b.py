"""A plain torch.distributed.pipelining trainer, plus the one line that puts vpipe under it.

Run with torchrun (4 ranks = 4 stages)::

    torchrun --standalone --nproc-per-node 4 examples/train_1f1b.py --steps 20
    torchrun --standalone --nproc-per-node 4 examples/train_1f1b.py --steps 20 --vpipe

Everything except the ``vpipe.attach`` line is what a user already has: a model split into
stages by layer, a ``PipelineStage``, a ``Schedule1F1B``, an optimizer and a loop.
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

WIDTH = int(os.environ.get("EXAMPLE_WIDTH", "64"))


class ResidualMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_layer(layer_id: int, spec: object = None) -> nn.Module:
    """The user's model, one layer at a time; initial weights depend only on the layer id."""
    torch.manual_seed(1234 + layer_id)
    return ResidualMLP(WIDTH)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(size, 16, WIDTH, generator=gen)
    return x, x.roll(1, dims=1).tanh()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--partition", default="6,2,2,2", help="layers per stage (unbalanced on purpose)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--vpipe", action="store_true", help="attach vpipe (the one line below)")
    parser.add_argument("--no-planning", action="store_true")
    parser.add_argument("--out", default=None, help="write the losses here (last stage)")
    parser.add_argument("--log-file", default=None, help="vpipe's decisions go here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [int(c) for c in args.partition.split(",")]
    assert len(counts) == world and sum(counts) == args.layers, "partition must give every rank its layers"
    first = sum(counts[:rank])
    module = nn.Sequential(OrderedDict((str(i), make_layer(i)) for i in range(first, first + counts[rank])))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    schedule = Schedule1F1B(stage, args.micro_batches, loss_fn=F.mse_loss)

    if args.vpipe:
        import vpipe

        vpipe.attach(schedule, optimizer=optimizer, layer_factory=make_layer, planning=not args.no_planning,
                     sample_every=2, planner_options={"warmup_samples": 1, "cooldown_steps": 4},
                     log_file=args.log_file)

    losses_per_step = []
    for step in range(args.steps):
        x, y = batch(step, 4 * args.micro_batches)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if losses:
            losses_per_step.append([float(loss.detach()) for loss in losses])
    if rank == world - 1 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses_per_step, "layers": [int(n) for n in module._modules]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
