"""Several stages per rank, the way torchtitan runs them: Interleaved
1F1B, LoopedBFS, the zero-bubble schedules.

Run with torchrun (2 ranks, 2 virtual stages each)::

    torchrun --standalone --nproc-per-node 2 examples/train_multistage.py --schedule interleaved1f1b
    torchrun --standalone --nproc-per-node 2 examples/train_multistage.py --schedule zbv --vpipe

The model is the torch pipelining tutorial's (``examples/train_tutorial.py``). Every rank
builds the whole model and cuts one chunk per virtual stage it runs, as torchtitan does:
stages ``r, r + W, ...`` on rank ``r`` for the looped schedules, stages ``r`` and
``2W - 1 - r`` (a V) for ZBV and DualPipeV. One optimizer holds every local chunk's
parameters. ``--partition`` gives the layers of each virtual stage, uneven on purpose:
with ``--vpipe`` the planner moves blocks between neighbouring virtual stages (on the same
rank, a local re-parenting; on another, a transfer), and the chunks' ``forward`` never notices.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from train_tutorial import ModelArgs, Transformer, batch, split_model, tokenwise_loss_fn

SCHEDULES = {
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "loopedbfs": ScheduleLoopedBFS,
    "interleavedzb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
V_SHAPED = ("zbv", "dualpipev")


def stages_of_rank(schedule: str, rank: int, world: int, per_rank: int) -> list[int]:
    """The virtual stages a rank runs, in model order."""
    if schedule in V_SHAPED:
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(per_rank)]


def build(schedule: str, counts: list[int], rank: int, world: int, model_args: ModelArgs,
          micro_batches: int) -> tuple[list[Transformer], list[PipelineStage], torch.optim.Optimizer, object]:
    """This rank's model chunks, their pipeline stages, one optimizer over all of them, and the schedule."""
    torch.manual_seed(0)  # every rank builds the same full model, then cuts its chunks
    full = Transformer(model_args)
    mine = stages_of_rank(schedule, rank, world, len(counts) // world)
    chunks = [split_model(copy.deepcopy(full), v, counts) for v in mine]
    stages = [PipelineStage(chunk, v, len(counts), torch.device("cpu")) for chunk, v in zip(chunks, mine)]
    optimizer = torch.optim.AdamW([p for chunk in chunks for p in chunk.parameters()], lr=1e-3)
    runner = SCHEDULES[schedule](stages, micro_batches, loss_fn=tokenwise_loss_fn)
    return chunks, stages, optimizer, runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="interleaved1f1b")
    parser.add_argument("--partition", default="3,1,1,3", help="layers per virtual stage (2 per rank)")
    parser.add_argument("--dim", type=int, default=int(os.environ.get("EXAMPLE_WIDTH", "64")))
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vpipe", action="store_true", help="attach vpipe (the one line below)")
    parser.add_argument("--out", default=None, help="write the losses and this rank's chunks' state here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [int(c) for c in args.partition.split(",")]
    if len(counts) % world:
        raise SystemExit(f"--partition {args.partition} names {len(counts)} stages for {world} ranks")
    model_args = ModelArgs(dim=args.dim, n_layers=sum(counts))
    chunks, _, optimizer, schedule = build(args.schedule, counts, rank, world, model_args, args.micro_batches)
    mine = stages_of_rank(args.schedule, rank, world, len(counts) // world)

    if args.vpipe:
        import vpipe

        vpipe.attach(schedule, optimizer=optimizer)  # the one line

    losses_per_step, step_s = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        x, y = batch(step, args.micro_batches * args.micro_batch_size, args.seq_len, model_args.vocab_size)
        losses = train_step(schedule, optimizer, x, y, first=0 in mine, last=len(counts) - 1 in mine)
        step_s.append(time.perf_counter() - started)
        if losses:
            losses_per_step.append(losses)
    if args.out:
        torch.save({v: chunk.state_dict() for v, chunk in zip(mine, chunks)}, f"{args.out}.rank{rank}.pt")
        if len(counts) - 1 in mine:
            with open(args.out, "w") as f:
                json.dump({"losses": losses_per_step, "step_s": step_s}, f)
    dist.barrier()
    dist.destroy_process_group()


def train_step(schedule, optimizer, x, y, *, first: bool, last: bool) -> list[float]:
    """One step: the schedule runs every micro-batch's forward and backward, then the optimizer steps.
    The rank with the first stage feeds the inputs, the one with the last the targets (its losses return)."""
    losses: list[torch.Tensor] = []
    inputs = (x,) if first else ()
    if last:
        schedule.step(*inputs, target=y, losses=losses)
    else:
        schedule.step(*inputs)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [float(loss.detach()) for loss in losses]


if __name__ == "__main__":
    main()
