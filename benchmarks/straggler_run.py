"""A straggler on 2 CPU ranks, with vpipe's one line, and what vpipe decides.

The trainer of examples/train_sequential.py (8 residual MLP blocks, split 4,4, 1F1B, 4
micro-batches); every block that runs on rank 1 takes ``--factor`` times as long for the whole
run, and 2x from step ``--on`` to step ``--off`` (modelled by waiting,
vpipe_lab.runtime.slowdown, so the two ranks on two cores do not slow each
other). Rank 0 prints its step times (ms); vpipe's decisions go to ``--decisions``::

    torchrun --standalone --nproc-per-node 2 benchmarks/straggler_run.py --on 40 --off 120 --steps 200
    torchrun --standalone --nproc-per-node 2 benchmarks/straggler_run.py --factor 2 --steps 60
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_sequential import ResidualMLP, batch  # noqa: E402
from vpipe_lab.runtime.slowdown import SlowDevice, of_class  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import vpipe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, default=1.0,
                        help="rank 1's blocks this much slower all along")
    parser.add_argument("--on", type=int, default=-1, help="from this step rank 1's blocks are 2x slower")
    parser.add_argument("--off", type=int, default=-1, help="and from this step as fast as rank 0's again")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--decisions", default="vpipe-straggler.jsonl", help="vpipe's run log (JSON lines)")
    args = parser.parse_args(argv)
    width, on, off = args.width, args.on, args.off
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [ResidualMLP(width) for _ in range(8)]
    module = nn.Sequential(*layers[4 * rank:4 * rank + 4])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    schedule = Schedule1F1B(stage, 4, loss_fn=F.mse_loss)
    slow = SlowDevice(args.factor if rank == 1 else 1.0, modules=of_class(ResidualMLP))
    vpipe.attach(schedule, optimizer=optimizer, log_file=args.decisions)
    times = []
    for step in range(args.steps):
        if rank == 1 and step in (on, off):
            slow.set_factor(2.0 if step == on else 1.0)
        x, y = batch(step, 8, 32, width)
        started = time.perf_counter()
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        times.append(time.perf_counter() - started)
    if rank == 0:
        print("steps ms", [round(t * 1e3) for t in times], flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
