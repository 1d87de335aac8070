"""Rank program for tests/integration/test_move_hangs.py: a trainer whose peer stops in the middle of a move.

``python hang_worker.py TIMEOUT_S PIDS_DIR [TARGET]``: the plainest 2-stage trainer
(``nn.Sequential`` of four blocks, 1F1B), which sets its own
``init_process_group(timeout=TIMEOUT_S)``, as a trainer under torchrun does, attaches vpipe and
asks for one block to move to rank TARGET (default 1) before step 2. With
``VPIPE_FAULTS=migration_stop@TARGET`` that rank stops itself (SIGSTOP) when the move's
announcement reaches it. Each rank writes its pid to ``PIDS_DIR/rank{r}`` first, so the test
can watch it.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import vpipe

WIDTH, STEPS = 16, 6


def main(timeout_s: float, pids: Path, target: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    (pids / f"rank{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]
    module = nn.Sequential(*layers[2 * rank:2 * rank + 2])
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, 2, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    vp = vpipe.attach(schedule, optimizer=optimizer, planning=False)
    stages = ((0,), (1, 2, 3)) if target == 1 else ((0, 1, 2), (3,))
    vp.request_plan(vpipe.Plan(epoch=1, stages=stages), at_step=2)
    x = torch.randn(4, WIDTH)
    for _ in range(STEPS):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=x)
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(float(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
