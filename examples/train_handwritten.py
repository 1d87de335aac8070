"""A hand-written GPipe loop (plain ``dist.send``/``dist.recv``), plus the one line that puts vpipe under it.

Run with torchrun (one rank per stage)::

    torchrun --standalone --nproc-per-node 2 examples/train_handwritten.py --steps 20
    torchrun --standalone --nproc-per-node 2 examples/train_handwritten.py --steps 20 --vpipe

No schedule object here: the trainer runs every micro-batch's forward, then every
backward, then ``optimizer.step()``. ``vpipe.attach(module, optimizer=...)`` takes the
optimizer's step as the step boundary; layers it moves between stages appear in and
disappear from ``module`` (the same object the loop keeps calling).
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from train_1f1b import WIDTH, batch, make_layer  # the same model and data as the schedule example

SEQ = 16


def train_step(module: nn.Module, rank: int, world: int, x: torch.Tensor, y: torch.Tensor,
               micro_batches: int) -> list[float]:
    """GPipe by hand: all forwards, then all backwards; activations
    and gradients cross stages by send/recv."""
    inputs, outputs, losses = [], [], []
    for xb, yb in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        if rank == 0:
            inp = xb
        else:
            inp = torch.empty(xb.shape[0], SEQ, WIDTH)
            dist.recv(inp, rank - 1)
            inp.requires_grad_()
        out = module(inp)
        if rank == world - 1:
            losses.append(F.mse_loss(out, yb) / micro_batches)
        else:
            dist.send(out.detach(), rank + 1)
        inputs.append(inp)
        outputs.append(out)
    for mb in range(micro_batches):
        if rank == world - 1:
            losses[mb].backward()
        else:
            grad = torch.empty_like(outputs[mb])
            dist.recv(grad, rank + 1)
            outputs[mb].backward(grad)
        if rank > 0:
            dist.send(inputs[mb].grad, rank - 1)
    return [float(loss.detach()) * micro_batches for loss in losses]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--partition", default="6,2", help="layers per stage (unbalanced on purpose)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--vpipe", action="store_true", help="attach vpipe (the one line below)")
    parser.add_argument("--no-planning", action="store_true")
    parser.add_argument("--policy", default=None, choices=["D", "S", "R"], help="vpipe: every layer's policy")
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
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)

    if args.vpipe:
        import vpipe

        policies = {i: args.policy for i in range(args.layers)} if args.policy else None
        vpipe.attach(module, optimizer=optimizer, layer_factory=make_layer, planning=not args.no_planning,
                     policies=policies, micro_batches=args.micro_batches, sample_every=2,
                     planner_options={"warmup_samples": 1, "cooldown_steps": 4}, log_file=args.log_file)

    losses_per_step = []
    for step in range(args.steps):
        x, y = batch(step, 4 * args.micro_batches)
        losses = train_step(module, rank, world, x, y, args.micro_batches)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if losses:
            losses_per_step.append(losses)
    if rank == world - 1 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses_per_step, "layers": [int(n) for n in module._modules]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
